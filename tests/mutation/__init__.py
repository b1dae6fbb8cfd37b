"""The mutation check: faults planted one at a time in a copy of the library, each of which some test must catch
(``make mutation-check``; see check.py). Not collected by pytest: no file here is named ``test_*``."""
