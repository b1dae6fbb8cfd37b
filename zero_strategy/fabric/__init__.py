"""The Lightning Fabric adapter: ZeroFabricStrategy and ZeroFabricPrecision, on the core and checkpoint code the
Trainer adapter (zero_strategy/lightning/) uses too. What both adapters share is Lightning-facing plumbing in
zero_strategy/adapter_plumbing/ (as Lightning's Trainer strategies import ``lightning.fabric.utilities``); the
modules here named after it (distributed.py, process_per_device.py, strategy_options.py, forward_entry.py,
exit_teardown.py, sharded_init.py) only keep old import paths working."""
