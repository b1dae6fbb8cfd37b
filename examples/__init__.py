"""Examples of zero_strategy: a character-level GPT trained with ZeRO (run ``examples/train.py``)."""
