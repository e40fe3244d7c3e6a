"""Tiny GGUF files made from tiny Hugging Face-layout models as llama.cpp's converter makes them:
llama.cpp tensor names, Q/K rows permuted for interleaved rotary, the tokenizer in the metadata.

F32/F16 files are written by `mx.save_gguf`; the block formats (Q8_0, Q4_0, Q4_1) by a small writer
here, which also returns the exact values the blocks stand for.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from support.tinymodels import make_tiny_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock!",
    "def main():\n    return 42  # answer\n\n\tTabs and  double  spaces.",
    "Speculative decoding: a draft proposes, the target verifies; naïve café ünïcödé.",
] * 20
TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8}


def bpe_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a small GPT-2-style byte-level BPE (digits split, like SmolLM2's); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def make_bpe_model(path: Path, seed: int = 0, **kw) -> Path:
    """A tiny random llama with the byte-level BPE tokenizer (ids 0-2 are the specials)."""
    n = bpe_tokenizer(path / ".tok")
    make_tiny_model(path, seed=seed, vocab_rows=n, **kw)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / ".tok" / f).replace(path / f)
    (path / ".tok").rmdir()
    return path


# mlx-lm module name -> llama.cpp tensor name (tensor_mapping.py's targets), per layer and global
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",  # GLM-4.5 / DeepSeek name them plural
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
    "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
    "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps",
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


# Gemma 2/3 and OLMo 2 have norms after attention and after the MLP
POST_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(name: str, case: str = "llama") -> str:
    """HF (mlx-lm) tensor name -> llama.cpp's, for a model of architecture `case`."""
    module, suffix = name.rsplit(".", 1)
    if module in GLOBAL:
        return f"{GLOBAL[module]}.{suffix}"
    _, _, i, rest = module.split(".", 3)
    if suffix == "e_score_correction_bias":  # the converter's exp_probs_b, stored as a bias
        return f"blk.{i}.exp_probs_b.bias"
    table = {**LAYER, **POST_NORMS} if case in ("gemma2", "gemma3", "olmo2", "glm4moe") else LAYER
    return f"blk.{i}.{table[rest]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rotary rows -> interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tokenizer_metadata(src: Path, pre: str = "smollm") -> dict:
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for added in data["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def model_metadata(config: dict) -> dict:
    a = config["model_type"]
    return {
        "general.architecture": a,
        "general.name": "tiny",
        f"{a}.context_length": config["max_position_embeddings"],
        f"{a}.embedding_length": config["hidden_size"],
        f"{a}.block_count": config["num_hidden_layers"],
        f"{a}.feed_forward_length": config["intermediate_size"],
        f"{a}.attention.head_count": config["num_attention_heads"],
        f"{a}.attention.head_count_kv": config["num_key_value_heads"],
        f"{a}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{a}.rope.freq_base": float(config["rope_theta"]),
        f"{a}.rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
    }


def _mx_meta(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        if isinstance(v, bool):
            out[k] = mx.array(v)
        elif isinstance(v, int):
            out[k] = mx.array(v, dtype=mx.uint32)
        elif isinstance(v, float):
            out[k] = mx.array(v, dtype=mx.float32)
        elif isinstance(v, list) and v and isinstance(v[0], int):
            out[k] = mx.array(v, dtype=mx.int32)
        elif isinstance(v, list) and v and isinstance(v[0], float):
            out[k] = mx.array(v, dtype=mx.float32)
        else:
            out[k] = v
    return out


def _quantize(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """GGUF blocks of 32 (llama.cpp's reference quantizers) and the values they decode to."""
    b = x.astype(np.float32).reshape(-1, 32)
    if kind == "q8_0":
        d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16)
        d32 = np.where(d == 0, 1, d).astype(np.float32)
        q = np.clip(np.round(b / d32), -127, 127).astype(np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
        return raw.tobytes(), (q * d.astype(np.float32)).reshape(x.shape)
    if kind == "q4_0":
        m = np.take_along_axis(b, np.abs(b).argmax(1)[:, None], 1)
        d = (m / -8).astype(np.float16)
        d32 = np.where(d == 0, 1, d).astype(np.float32)
        q = np.clip(np.round(b / d32 + 8), 0, 15).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        raw = np.concatenate([d.view(np.uint8), packed], axis=1)
        return raw.tobytes(), ((q.astype(np.float32) - 8) * d.astype(np.float32)).reshape(x.shape)
    if kind == "q4_1":
        lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        d32 = np.where(d == 0, 1, d).astype(np.float32)
        q = np.clip(np.round((b - m.astype(np.float32)) / d32), 0, 15).astype(np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)
        raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=1)
        dec = q.astype(np.float32) * d.astype(np.float32) + m.astype(np.float32)
        return raw.tobytes(), dec.reshape(x.shape)
    raise ValueError(kind)


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, v) -> bytes:
    out = _string(key)
    if isinstance(v, bool):
        return out + struct.pack("<IB", 7, v)
    if isinstance(v, int):
        return out + struct.pack("<II", 4, v)
    if isinstance(v, float):
        return out + struct.pack("<If", 6, v)
    if isinstance(v, str):
        return out + struct.pack("<I", 8) + _string(v)
    if v and isinstance(v[0], str):
        return out + struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(s) for s in v)
    return out + struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)


def write_blocks_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], meta: dict) -> None:
    """A GGUF v3 file; tensors map name -> (array, "f32" | "q8_0" | "q4_0" | "q4_1")."""
    infos, blobs, offset = b"", [], 0
    for name, (a, kind) in tensors.items():
        if isinstance(kind, tuple):  # ("raw", GGUF type id, byte count): zeros of any type
            raw, kind = bytes(kind[2]), kind[1]
        elif kind == "f32":
            raw = a.astype(np.float32).tobytes()
        else:
            raw = _quantize(a, kind)[0]
        dims = struct.pack(f"<{a.ndim}Q", *a.shape[::-1])
        infos += _string(name) + struct.pack("<I", a.ndim) + dims
        infos += struct.pack("<IQ", TYPES.get(kind, kind), offset)
        pad = (-len(raw)) % 32
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(_kv(k, v) for k, v in meta.items()) + infos
    head += b"\0" * ((-len(head)) % 32)
    path.write_bytes(head + b"".join(blobs))


def spm_metadata(model_file: Path) -> dict:
    """A SentencePiece model as llama.cpp stores it: pieces, scores and token types."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_control(i):
            return 3
        if sp.is_unknown(i):
            return 2
        return 6 if sp.is_byte(i) else 1

    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }


def hf_to_gguf(
    src: Path, out: Path, kind: str = "f32", pre: str = "smollm", tok_meta: dict | None = None
) -> dict:
    """Write the model in `src` as a GGUF file; returns the weights (HF names, float32) that the
    file stands for, so a test can build the exact reference model."""
    config = json.loads((src / "config.json").read_text())
    weights = {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    tok_meta = tokenizer_metadata(src, pre) if tok_meta is None else tok_meta
    meta = {**model_metadata(config), **tok_meta}
    tensors, reference = {}, {}
    for name, w in weights.items():
        g = w
        llama = config["model_type"] == "llama"  # llama.cpp permutes Q/K for llama only
        if llama and name.endswith("q_proj.weight"):
            g = permute(w, config["num_attention_heads"])
        elif llama and name.endswith("k_proj.weight"):
            g = permute(w, config["num_key_value_heads"])
        t = kind if (w.ndim == 2 and kind.startswith("q")) else ("f32" if w.ndim == 1 else kind)
        tensors[gguf_name(name)] = (g, t)
        reference[name] = w
        if t.startswith("q"):
            # Blocks lie within rows, so decoding `w` equals decoding `g` with its rows put back.
            reference[name] = _quantize(w, t)[1]
        elif t == "f16":
            reference[name] = w.astype(np.float16).astype(np.float32)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_freqs(config), "f32")
    if kind in ("f32", "f16"):
        dtype = {"f32": mx.float32, "f16": mx.float16}[kind]
        arrays = {
            n: mx.array(a).astype(mx.float32 if a.ndim == 1 else dtype)
            for n, (a, _) in tensors.items()
        }
        mx.save_gguf(str(out), arrays, _mx_meta(meta))
    else:
        write_blocks_gguf(out, tensors, meta)
    return reference


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs tensor for Llama 3.1 rope scaling (written independently)."""
    scaling = config["rope_scaling"]
    dim = config["hidden_size"] // config["num_attention_heads"]
    inv = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    old = scaling.get("original_max_position_embeddings", 8192)
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 0.0))
    mid = (wavelen >= old / high) & (wavelen <= old / low)
    out[mid] = 1 / ((1 - smooth[mid]) / factor + smooth[mid])
    return out.astype(np.float32)


def make_qwen2_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 (biased Q/K/V projections, tied embeddings) with the BPE tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    n = bpe_tokenizer(path)
    config = {
        "model_type": "qwen2",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": n,
        "max_position_embeddings": 256,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    params = {
        k: (v * 4 if "embed" in k else v + 0.1 * mx.random.normal(v.shape))
        for k, v in params.items()
    }
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    return path
