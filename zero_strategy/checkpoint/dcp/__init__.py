"""``torch.distributed.checkpoint`` interchange, written and read without gathering. Imports ``checkpoint/base``
and ``checkpoint/sharded``; importing this package loads none of torch's DCP modules (``checkpoint/dcp/paths.py``
recognises a DCP directory without them)."""
