"""The flat room: a FlatParam and what it owns — its storage (gathered buffer, master slice, offload placement),
master pieces, gradient slices, the hierarchical secondary copy, the in-place-change watch."""
