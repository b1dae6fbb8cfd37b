"""What the two Lightning adapters (zero_strategy/lightning/: the Trainer's ZeroStrategy, zero_strategy/fabric/:
ZeroFabricStrategy) share and that only makes sense next to Lightning: the process group and the rank layout as a
Lightning cluster environment describes them (process_group.py, process_per_device.py), the strategies' constructor
options (strategy_options.py), the module handed to Lightning as the forward module (forward_entry.py), and taking
over one Lightning connector's precision choice (precision_takeover.py).

It is grouped as Lightning groups ``lightning.fabric.utilities``, which both its Fabric and its Trainer strategies
import; it sits beside the adapters rather than inside fabric/ so that fabric/ is the Fabric adapter and nothing
else. Logic that needs no Lightning lives below (core/, checkpoint/, initial_values.py), and the only collectives
here are the Lightning strategies' own ``barrier``/``broadcast``/``reduce``, which call core/comm/control.py and
Lightning's reduction (tests/unit/test_adapter_walls.py holds both rules).
"""
