"""The Lightning Fabric adapter: ZeroFabricStrategy and ZeroFabricPrecision, on the core and checkpoint code the
Trainer adapter (zero_strategy/lightning/) uses too; helpers both adapters need live here and the Trainer's side
imports them, as Lightning's own Trainer strategies import theirs from its Fabric side."""
