"""What every checkpoint room uses: the format and manifest, safetensors streaming, RNG state, the read and write
protocols. Imports no other checkpoint room."""
