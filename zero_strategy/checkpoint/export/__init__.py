"""``zero-to-fp32``: a sharded checkpoint consolidated into one plain file or a Hugging Face model directory.
Imports ``checkpoint/base`` and ``checkpoint/sharded``."""
