"""Sharded checkpoints: readable without Lightning (the consolidation tool needs only torch and this folder)."""
