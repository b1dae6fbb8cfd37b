"""Shared test helpers: small models, single-process references and storage accounting.

Nothing here imports the code under test except where a helper drives it (``engine_step``); references are
computed with plain torch.
"""
