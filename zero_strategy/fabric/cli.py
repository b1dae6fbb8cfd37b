"""``zero-fabric run`` (or ``python -m zero_strategy.fabric run``): Lightning's ``fabric run`` with the ZeRO names.

Lightning's CLI takes ``--strategy`` from a fixed list built from Fabric's strategy registry when its module is
imported, and nothing imports ``zero_strategy`` before that in the ``fabric`` command (Lightning has no plugin
discovery for strategies). Here the package is imported first (this module lives in it: ``import zero_strategy``
runs, and registers the names, before this module's code), then Lightning's CLI takes over unchanged:
``zero-fabric run --strategy zero3 --accelerator cpu --devices 2 train.py``. The launched script creates its
``Fabric()`` after ``import zero_strategy``, which reads the choice from the environment the CLI set. Names with
``offload`` or ``spawn`` are left out by Lightning's CLI itself (they need options or another launcher); pass
``ZeroFabricStrategy(...)`` in the script for those.
"""

from __future__ import annotations


def main() -> None:
    from lightning.fabric.cli import _main

    _main()
