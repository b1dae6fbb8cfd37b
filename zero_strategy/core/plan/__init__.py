"""The plan room: decisions made from shapes and the launcher alone, before any buffer exists — the units, the
FlatParams of each unit and their flat layout, the rank topology (nodes, shard and replica groups), the precision
policy."""
