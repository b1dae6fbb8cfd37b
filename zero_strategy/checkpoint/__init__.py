"""Checkpoints, readable and writable without Lightning (the consolidation tool needs only torch and this folder).

Rooms, each importing only the rooms before it (tests/unit/test_package_rooms.py holds it):

- ``base/``: the on-disk format and manifest, streaming safetensors, every rank's RNG state, and the two protocols
  the rest is written against: what a checkpoint writer reads from a sharded source (``checkpoint/base/writable.py``)
  and what loading asks of a checkpoint (``checkpoint/base/source.py``).
- ``sharded/``: our own sharded directory: save, the reader, load into an engine, what a shard file holds, and a
  module saved as a one-rank checkpoint.
- ``dcp/``: ``torch.distributed.checkpoint`` interchange: the boxes of a flat range, the planner, storage, online
  save, offline export (``zero-to-dcp``), reading other tools' DCP directories and loading them.
- ``export/``: ``zero-to-fp32``: consolidation into one file, the Hugging Face directory (``--hf``), the CLI.
- ``pretrained/``: pretrained weights read by name and element range, from any kind of file.
- ``strategy_io/``: what both Lightning adapters call: the writer that ``checkpoint_format`` picks, the manifest's
  facts, whole (consolidated) state dicts.

The modules directly in this folder (``consolidate``, ``hf_export``, ``save``, ``dcp_load``, ``dcp_cli``) are the
old import paths, kept as aliases of their new homes; ``__main__`` is ``python -m zero_strategy.checkpoint``.
"""
