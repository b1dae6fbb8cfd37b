"""Old import path of ``zero_strategy.checkpoint.dcp.load`` (where loading a ``torch.distributed.checkpoint``
directory into an engine lives now); kept so that code importing from here keeps working."""

from zero_strategy.checkpoint.dcp.load import check_dcp_compatible, dcp_buffers, load_dcp, module_keys, param_groups_for

__all__ = ["check_dcp_compatible", "dcp_buffers", "load_dcp", "module_keys", "param_groups_for"]
