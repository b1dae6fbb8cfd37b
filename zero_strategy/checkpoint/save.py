"""Old import path of ``zero_strategy.checkpoint.sharded.save`` (where the sharded writer lives now); kept so that
code importing from here keeps working."""

from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded

__all__ = ["SaveInfo", "save_sharded"]
