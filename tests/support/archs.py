"""The mlx-lm architectures macspec refuses, and why (models/compat.py's cache check)."""

REFUSED = {
    "llama4": "ChunkedKVCache",
    "mamba": "recurrent",
    "jamba": "recurrent",
    "rwkv7": "recurrent",
    "recurrent_gemma": "recurrent",
    "baichuan_m1": "recurrent",
}
