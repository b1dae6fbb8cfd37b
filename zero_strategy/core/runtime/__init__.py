"""The runtime room: what happens inside forward and backward — the unit hooks that gather, reduce and free, the
agreed reduction order, activation checkpointing, torch.compile checks."""
