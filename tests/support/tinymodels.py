"""Tiny llama-style models and a character tokenizer, built by the tests themselves.

Every test model is made here from a seed, so no test depends on downloaded weights.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

SPECIALS = ["<pad>", "<s>", "</s>"]
DEFAULT_CHARS = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'\n"


def write_char_tokenizer(path: Path, chars: str = DEFAULT_CHARS, add_bos: bool = False) -> int:
    """Write a character-level tokenizer.json (+ config); returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return len(vocab)


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_rows: int | None = None,
    chars: str = DEFAULT_CHARS,
    scale: float = 1.0,
    context: int = 256,
    tie: bool = True,
    dtype: mx.Dtype = mx.float32,
    perturb: float = 0.0,
    perturb_seed: int = 1,
) -> Path:
    """Build and save a random llama model with a character tokenizer; returns its directory.

    `vocab_rows` pads the embedding beyond the tokenizer's vocabulary, as real models do.
    `scale` multiplies the output head so that distributions are peaked rather than flat.
    `perturb` adds relative noise to every weight: a noisy copy of a target makes a draft that
    agrees with it part of the time, like a real draft.
    """
    path = Path(path)
    n_vocab = write_char_tokenizer(path, chars)
    rows = vocab_rows or n_vocab
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": rows,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    params[head] = params[head] * scale
    if perturb:
        keys = mx.random.split(mx.random.key(perturb_seed), len(params))
        params = {
            k: v + perturb * mx.std(v) * mx.random.normal(v.shape, key=keys[i])
            for i, (k, v) in enumerate(sorted(params.items()))
        }
    params = {k: v.astype(dtype) for k, v in params.items()}
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def llama_like(module: Any = llama, seed: int = 3, **over: Any) -> Any:
    """An in-memory mlx-lm model of `module` (llama, qwen2, ...) in a tiny llama-style shape,
    for tests that compare layer paths on one set of weights."""
    config = {
        "model_type": "llama",
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **over,
    }
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def chunk_logits(model: Any, chunks: list[list[int]]) -> list[np.ndarray]:
    """Logits of each chunk fed in turn through one KV cache (a prefill, then steps)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    return [np.array(model(mx.array([c]), cache=cache)[0]) for c in chunks]
