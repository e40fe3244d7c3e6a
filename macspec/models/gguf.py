"""GGUF -> Hugging Face/MLX layout: weights renamed from llama.cpp's names (undoing the Q/K row
order llama.cpp's converter applies), a config.json, and a tokenizer.json rebuilt from metadata.

`mx.load` reads GGUF: F32/F16 come back as arrays, Q4_0/Q4_1/Q8_0 as MLX affine-quantized triplets
(`weight`, `scales`, `biases`, group size 32) and the K-quants dequantized to float16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ConvertError

GGUF_GROUP_SIZE = 32  # every GGUF block format that MLX keeps packed uses 32 weights per block

# llama.cpp tensor names -> Hugging Face names (per layer / global).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUFFIXES = ("weight", "scales", "biases", "bias")

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> the pre-tokenizer the original Hugging Face tokenizer.json used
# (the regexes are llama.cpp's llama-vocab.cpp ones, which copy the HF tokenizers').
_GPT2_PRE = {"default", "gpt-2", "gpt2", "phi-2", "roberta-bpe", "jina-es", "jina-de"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    "llama-bpe": _LLAMA3_RE,
    "llama3": _LLAMA3_RE,
    "smaug-bpe": _LLAMA3_RE,
    "qwen2": _QWEN2_RE,
    "deepseek-r1-qwen": _QWEN2_RE,
}
SUPPORTED_PRE = sorted(_GPT2_PRE | _DIGITS_PRE | set(_SPLIT_PRE))


def is_gguf(path: Path) -> bool:
    """True when `path` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# GGUF general.architecture -> Hugging Face architecture class (model_type is the same name).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# GGUF tensor types -> names; MLX reads these (the K-quants and BF16 come back as float16).
GGUF_TYPES = {
    0: "F32",
    1: "F16",
    30: "BF16",
    8: "Q8_0",
    2: "Q4_0",
    3: "Q4_1",
    10: "Q2_K",
    12: "Q4_K",
    14: "Q6_K",
}
_OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS"}
_OTHER_TYPES.update({17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S"})
_OTHER_TYPES.update({22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0"})
# Sizes of GGUF metadata value types (uint8 .. float64); 8 = string and 9 = array are variable.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_types(path: Path) -> dict[str, int]:
    """Each tensor's GGUF type id, read from the header (MLX silently drops unknown types)."""
    import struct

    with open(path, "rb") as f:

        def read(fmt: str):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ConvertError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, data)

        def skip_string() -> None:
            (n,) = read("<Q")
            f.seek(n, 1)

        def skip_value(kind: int) -> None:
            if kind == 8:
                skip_string()
            elif kind == 9:
                inner, count = read("<IQ")
                if inner in _VALUE_SIZES:
                    f.seek(_VALUE_SIZES[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(inner)
            elif kind in _VALUE_SIZES:
                f.seek(_VALUE_SIZES[kind], 1)
            else:
                raise ConvertError(f"{path}: corrupt GGUF metadata (value type {kind})")

        magic, version = read("<4sI")
        if magic != b"GGUF" or version < 2:
            raise ConvertError(f"{path}: not a GGUF v2/v3 file")
        n_tensors, n_kv = read("<QQ")
        for _ in range(n_kv):
            skip_string()
            skip_value(read("<I")[0])
        types = {}
        for _ in range(n_tensors):
            (n,) = read("<Q")
            name = f.read(n).decode("utf-8", "replace")
            (dims,) = read("<I")
            f.seek(8 * dims, 1)
            kind, _offset = read("<IQ")
            types[name] = kind
        return types


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata (plain Python values) of a GGUF file, or a ConvertError naming it."""
    if not path.is_file():
        raise ConvertError(f"{path}: no such GGUF file")
    if not is_gguf(path):
        raise ConvertError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    for name, kind in tensor_types(path).items():
        if kind not in GGUF_TYPES:
            label = _OTHER_TYPES.get(kind, f"unknown type {kind}")
            raise ConvertError(
                f"{path}: tensor '{name}' is stored as {label}, which MLX cannot read; supported: "
                + ", ".join(GGUF_TYPES.values())
                + " (pick another GGUF variant, e.g. Q4_K_M/Q8_0, or the Hugging Face repo)"
            )
    try:
        tensors, raw = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ConvertError(f"{path}: cannot read the GGUF file ({e})") from e
    meta = {}
    for key, value in raw.items():
        if isinstance(value, mx.array):
            value = value.item() if value.ndim == 0 else value.tolist()
        meta[key] = value
    return tensors, meta


def _undo_rope_permute(w: mx.array, n_head: int) -> mx.array:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (interleaved -> half-split rotary rows).

    It only reorders output rows, so it applies alike to weights and to quantized scales/biases.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[-1] not in _SUFFIXES:
        return None
    suffix = parts[-1]
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
    return None


def _meta(meta: dict, key: str, path: Path, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise ConvertError(f"{path}: GGUF metadata lacks '{key}'")
    return default


def _llama3_factors(base: float, dim: int, factor: float, low: float, high: float, old: int):
    """The per-frequency factors convert_hf_to_gguf stores as rope_freqs for Llama 3.1 rope."""
    import math

    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_scaling(freqs: mx.array, base: float, dim: int, path: Path) -> dict:
    """Recover Llama 3.1's rope_scaling from the rope_freqs tensor (GGUF keeps only the factors);
    the released Llama 3.x models all use low 1, high 4, original context 8192."""
    have = [float(x) for x in freqs.astype(mx.float32).tolist()]
    factor = max(have)
    want = _llama3_factors(base, dim, factor, 1.0, 4.0, 8192)
    close = all(abs(a - b) <= 1e-4 * b for a, b in zip(want, have, strict=False))
    if len(want) == len(have) and close:
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    raise ConvertError(
        f"{path}: its rope_freqs factors do not match Llama 3.1-style rope scaling; convert the "
        "model from its Hugging Face repo instead"
    )


def model_config(tensors: dict[str, mx.array], meta: dict, path: Path) -> dict:
    """A Hugging Face config.json for the GGUF's architecture (llama family, qwen2)."""
    arch = _meta(meta, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"{path}: GGUF architecture '{arch}' is not supported (only 'llama', which also covers "
            "Mistral/SmolLM/TinyLlama GGUFs, and 'qwen2'); convert the model from its Hugging Face "
            "repo instead"
        )
    p = f"{arch}."
    hidden = int(_meta(meta, p + "embedding_length", path))
    heads = int(_meta(meta, p + "attention.head_count", path))
    kv_heads = _meta(meta, p + "attention.head_count_kv", path, heads)
    if not isinstance(kv_heads, int):
        raise ConvertError(f"{path}: per-layer head counts are not supported")
    if "token_embd.weight" not in tensors:
        raise ConvertError(f"{path}: GGUF has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(meta, p + "block_count", path)),
        "intermediate_size": int(_meta(meta, p + "feed_forward_length", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_meta(meta, p + "attention.key_length", path, hidden // heads)),
        "rms_norm_eps": float(_meta(meta, p + "attention.layer_norm_rms_epsilon", path, 1e-5)),
        "rope_theta": float(_meta(meta, p + "rope.freq_base", path, 10000.0)),
        "max_position_embeddings": int(_meta(meta, p + "context_length", path, 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_scaling(
            tensors["rope_freqs.weight"], config["rope_theta"], config["head_dim"], path
        )
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConvertError(f"{path}: rope scaling '{scaling}' is not supported")
        factor = float(_meta(meta, p + "rope.scaling.factor", path))
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[hf] = int(meta[f"tokenizer.ggml.{key}"])
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and config.get("eos_token_id") not in (None, eot):
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]
    return config


def hf_weights(tensors: dict[str, mx.array], config: dict, path: Path) -> tuple[dict, dict]:
    """Rename tensors and undo the Q/K permutation; returns (weights, quantization config)."""
    weights: dict[str, mx.array] = {}
    for name, value in tensors.items():
        if name == "rope_freqs.weight":  # folded into config["rope_scaling"]
            continue
        hf = _hf_name(name)
        arch = config["model_type"]
        if hf is None:
            raise ConvertError(f"{path}: unexpected tensor '{name}' for architecture {arch}")
        # llama.cpp permutes Q/K rows for llama only (its Qwen2 converter leaves them as they are).
        if arch == "llama" and ".self_attn.q_proj." in hf:
            value = _undo_rope_permute(value, config["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in hf:
            value = _undo_rope_permute(value, config["num_key_value_heads"])
        weights[hf] = value
    # Packed GGUF blocks are MLX affine quantization in 32-weight groups; record each layer's bits.
    layers: dict[str, dict] = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed = weights[module + ".weight"]
            bits = packed.shape[-1] * 32 // (w.shape[-1] * GGUF_GROUP_SIZE)
            layers[module] = {"group_size": GGUF_GROUP_SIZE, "bits": int(bits), "mode": "affine"}
    quant: dict = {}
    if layers:
        bits = [q["bits"] for q in layers.values()]
        common = max(set(bits), key=bits.count)
        quant = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
        quant.update({m: q for m, q in layers.items() if q["bits"] != common})
    return weights, quant


# ---------------------------------------------------------------- tokenizer


def _added_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    return [
        AddedToken(tok, special=t == CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (CONTROL, USER_DEFINED)
    ]


def _bpe_pre_tokenizer(pre: str, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ConvertError(
        f"{path}: unknown BPE pre-tokenizer '{pre}' (tokenizer.ggml.pre); supported: "
        + ", ".join(SUPPORTED_PRE)
    )


def _gpt2_tokenizer(meta: dict, tokens: list[str], path: Path):
    from tokenizers import Tokenizer, decoders, models, processors

    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ConvertError(f"{path}: BPE tokenizer without merges (tokenizer.ggml.merges)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, ordered like transformers' SentencePieceExtractor:
    by the merged piece's score (higher first), then by the parts' ids."""
    merges = []
    for piece, pid in vocab.items():
        local = [
            (piece[:i], piece[i:], scores[pid])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConvertError(f"{path}: SentencePiece tokenizer lacks tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Merges only among normal pieces: control/byte tokens never come from merging.
    mergeable = {t: i for t, i in vocab.items() if types[i] in (NORMAL, USER_DEFINED)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(mergeable, scores),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # As llama.cpp and SentencePiece: spaces become "▁" and each text run (also one after a special
    # token) gets a "▁" in front, even one that starts with a space (Metaspace would skip that).
    norm = [normalizers.Replace(" ", "▁")]
    if prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def build_tokenizer(meta: dict, path: Path) -> tuple[Any, dict]:
    """A `tokenizers.Tokenizer` and a tokenizer_config.json dict rebuilt from GGUF metadata."""
    from tokenizers import processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ConvertError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.model/tokens missing)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tok = _gpt2_tokenizer(meta, tokens, path)
    elif kind == "llama":
        tok = _spm_tokenizer(meta, tokens, types, path)
    else:
        raise ConvertError(
            f"{path}: tokenizer type '{kind}' is not supported (only 'gpt2' BPE and 'llama' "
            "SentencePiece)"
        )
    tok.add_special_tokens(_added_tokens(tokens, types))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        # Same as the HF tokenizers of these models: a template adds BOS (and EOS) when asked.
        def part(seq: str, type_id: int) -> str:
            head = f"{bos}:{type_id} " if add_bos and bos else ""
            tail = f" {eos}:{type_id}" if add_eos and eos else ""
            return f"{head}{seq}:{type_id}{tail}"

        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]
        tok.post_processor = processors.TemplateProcessing(
            single=part("$A", 0),
            pair=f"{part('$A', 0)} {part('$B', 1)}",
            special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(used)],
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    for key in ("bos", "eos", "unk", "pad"):
        if token(key) is not None:
            config[f"{key}_token"] = token(key)
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def gguf_to_hf(path: Path, out_dir: Path) -> dict:
    """Write `path` as a Hugging Face-layout model into `out_dir` (kept quantized where GGUF packs
    it); returns the config written."""
    tensors, meta = read_gguf(path)
    config = model_config(tensors, meta, path)
    weights, quant = hf_weights(tensors, config, path)
    tok, tok_config = build_tokenizer(meta, path)
    tok_config["model_max_length"] = config["max_position_embeddings"]
    if quant:
        config["quantization"] = quant
        config["quantization_config"] = quant
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return config
