"""Our own sharded checkpoint directory: every rank writes its slices, any world size and stage reads them back.
Imports only ``checkpoint/base``."""
