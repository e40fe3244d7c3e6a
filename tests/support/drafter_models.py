"""Tiny random checkpoints in the exact published layouts of drafters people already have.

- MTP: a target of an architecture that ships multi-token-prediction heads, written as its
  Hugging Face checkpoint is (raw names and transforms, MTP tensors beside the trunk's), so that
  `macspec convert` meets what it meets on a real download. Per architecture:
    deepseek_v3 / glm4_moe  model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.{norm,head},
                            embed_tokens} + a decoder layer      (vLLM deepseek_mtp.py@03356f8c,
                            glm4_moe_mtp.py@028aedf6)
    qwen3_next / qwen3_5    mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm} +
                            mtp.layers.{i}.*, zero-centred norm gains, raw conv1d (C, 1, K)
                            (vLLM qwen3_next_mtp.py@055e47c2, qwen3_5_mtp.py@01d99805)
    mimo                    model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,
                            final_layernorm} + a Qwen2 layer (vLLM mimo_mtp.py@0bb55d60)
  Trunk layers are written in the form mlx-lm's sanitize reads (experts unstacked, DeepSeek's
  kv_b_proj whole, Qwen norms as w - 1): `hf_weights` inverts mlx-lm's own transforms.
- GGUF: `glm4moe_gguf` writes such a GLM-4.5 checkpoint as llama.cpp's converter does, its MTP
  layers as blk.{L+i}.* + blk.{L+i}.nextn.* (conversion/glm.py@051139f5, gguf-py 0.19 names).
- EAGLE-3: a tiny llama target and drafts for it in the three published formats (the EAGLE
  authors' cnets.py@bfeb532e / traineagle3 config, SpecForge llama3_eagle.py@d5f0c242 +
  configs/*-eagle3.json, speculators eagle3 config.py / converter@c05b95b3).

Every builder takes a seed; nothing is downloaded. notes/drafters/layouts.md cites each layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from macspec.models.mtp import make_block
from support.archzoo import ZOO, _scale_params, _write_byte_level_char_tokenizer, build_model
from support.tinymodels import make_tiny_model, write_char_tokenizer

# architecture -> (zoo entry, config key counting the heads, where it lives, trunk layer whose
# kind the head's block has: full attention / MoE as in the released models)
MTP_ARCHS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"zoo": "deepseek_v3", "count_key": "num_nextn_predict_layers", "block": 1},
    "glm4_moe": {"zoo": "glm4_moe", "count_key": "num_nextn_predict_layers", "block": 1},
    "qwen3_next": {"zoo": "qwen3_next", "count_key": "num_nextn_predict_layers", "block": 1},
    "qwen3_5": {"zoo": "qwen3_5", "count_key": "mtp_num_hidden_layers", "block": 1},
    "mimo": {"zoo": None, "count_key": "num_nextn_predict_layers", "block": 0},
}
ZERO_CENTRED = ("qwen3_next", "qwen3_5")
_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)

MIMO_CONFIG = {
    "model_type": "mimo",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": ZOO["llama"].config["vocab_size"],
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def mtp_config(arch: str, count: int, **over: Any) -> dict:
    """The HF config.json of a tiny `arch` target declaring `count` MTP heads (`over`: other
    values for its language model's config)."""
    spec = MTP_ARCHS[arch]
    config = json.loads(json.dumps(ZOO[spec["zoo"]].config if spec["zoo"] else MIMO_CONFIG))
    where = config["text_config"] if "text_config" in config else config
    where[spec["count_key"]] = count
    where.update(over)
    return config


# ------------------------------------------------------------------ mlx-lm -> Hugging Face


def _unstack(params: dict) -> dict:
    """switch_mlp.{p}.weight (E, ...) -> experts.{e}.{p}.weight, as released checkpoints hold."""
    out = {}
    for k, v in params.items():
        if ".switch_mlp." in k:
            base, rest = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{rest}"] = v[e]
        else:
            out[k] = v
    return out


def _join_kv_b(params: dict, config: dict) -> dict:
    """DeepSeek MLA: mlx-lm's embed_q / unembed_out back into the checkpoint's kv_b_proj."""
    out = {}
    for k, v in params.items():
        if k.endswith("self_attn.embed_q.weight"):
            base = k.removesuffix("embed_q.weight")
            wv = params[base + "unembed_out.weight"]
            joined = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)
            out[base + "kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])
        elif not k.endswith("self_attn.unembed_out.weight"):
            out[k] = v
    return out


def hf_weights(arch: str, params: dict, config: dict) -> dict:
    """mlx-lm parameters of a model (or of one decoder layer, keys relative to it) in the
    checkpoint's own form: the inverse of the architecture's mlx-lm sanitize."""
    out = _unstack(params)
    if arch in ("deepseek_v3",):
        out = _join_kv_b(out, config)
    if arch in ZERO_CENTRED:
        shifted = _NORMS + ("model.norm.weight",)
        out = {
            k: v - 1.0 if ("." + k).endswith(shifted) and v.ndim == 1 else v for k, v in out.items()
        }
        out = {
            k: v.moveaxis(1, 2) if "conv1d.weight" in k and v.shape[-1] == 1 else v
            for k, v in out.items()
        }
    if arch == "qwen3_5":
        out = {
            k.replace("language_model.model.", "model.language_model.").replace(
                "language_model.lm_head.", "lm_head."
            ): v
            for k, v in out.items()
        }
    return out


# ------------------------------------------------------------------ MTP heads


def _norm_gain(shape: tuple, key: Any, zero_centred: bool) -> mx.array:
    gain = 1.0 + 0.2 * mx.random.normal(shape, key=key)
    return gain - 1.0 if zero_centred else gain


def mtp_head_weights(arch: str, model: Any, config: dict, i: int, seed: int) -> dict:
    """Random weights of MTP head i under the checkpoint's own names."""
    spec = MTP_ARCHS[arch]
    text = config.get("text_config") or config
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    mx.random.seed(seed)
    block = make_block(model, spec["block"])
    params = dict(tree_flatten(block.parameters()))
    scale = ZOO[spec["zoo"]].scale if spec["zoo"] else {"gain": 2.5}
    params = _scale_params(block, params, {**scale, "zeros": scale.get("zeros", 0.2)})
    layer = hf_weights(arch, {"x." + k: v for k, v in params.items()}, text)
    layer = {k[2:]: v for k, v in layer.items()}
    keys = mx.random.split(mx.random.key(seed + 7), 4)
    zc = arch in ZERO_CENTRED
    fusion = {
        "embed_norm": _norm_gain((hidden,), keys[0], zc),
        "hidden_norm": _norm_gain((hidden,), keys[1], zc),
        "proj": mx.random.normal((hidden, 2 * hidden), key=keys[2]) * 2.0 / math.sqrt(2 * hidden),
        "out_norm": _norm_gain((hidden,), keys[3], zc),
    }
    if arch in ("deepseek_v3", "glm4_moe"):
        p = f"model.layers.{layers + i}."
        names = {"embed_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj"}
        names["out_norm"] = "shared_head.norm"
        out = {p + names[n] + ".weight": v for n, v in fusion.items()}
        # Released checkpoints repeat the embedding and output head in every MTP layer.
        trunk = dict(tree_flatten(model.parameters()))
        out[p + "embed_tokens.weight"] = trunk["model.embed_tokens.weight"]
        out[p + "shared_head.head.weight"] = trunk["lm_head.weight"]
        return out | {p + k: v for k, v in layer.items()}
    if arch in ZERO_CENTRED:
        p = f"mtp.layers.{i}."
        out = {p + k: v for k, v in layer.items()}
        if i == 0:  # one fc and its norms, shared by every head
            names = {"embed_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden"}
            names.update(proj="fc", out_norm="norm")
            out |= {f"mtp.{names[n]}.weight": v for n, v in fusion.items()}
        return out
    p = f"model.mtp_layers.{i}."
    names = {"embed_norm": "token_layernorm", "hidden_norm": "hidden_layernorm"}
    names.update(proj="input_proj", out_norm="final_layernorm")
    return {p + names[n] + ".weight": v for n, v in fusion.items()} | {
        p + k: v for k, v in layer.items()
    }


def mtp_trunk(arch: str, count: int = 1, seed: int = 0, **over: Any) -> Any:
    """The in-memory mlx-lm model whose trunk make_mtp_checkpoint writes (same seed)."""
    zoo = MTP_ARCHS[arch]["zoo"]
    scale = None if zoo else {"gain": 2.5}
    config = mtp_config(arch, count, **over)
    return build_model(zoo or "llama", seed=seed, config=config, scale=scale)


def make_mtp_checkpoint(
    path: str | Path, arch: str, *, count: int = 1, seed: int = 0, shards: int = 2, **over: Any
) -> Path:
    """A tiny `arch` target with `count` MTP heads as a Hugging Face checkpoint directory:
    config.json, model-0000k-of-0000n.safetensors (+ index), the character tokenizer."""
    path = Path(path)
    config = mtp_config(arch, count, **over)
    model = mtp_trunk(arch, count, seed, **over)
    text = config.get("text_config") or config
    weights = hf_weights(arch, dict(tree_flatten(model.parameters())), text)
    for i in range(count):
        weights |= mtp_head_weights(arch, model, config, i, seed=seed + 100 + i)
    write_char_tokenizer(path)
    if arch == "qwen3_5":
        _write_byte_level_char_tokenizer(path)
    _save_sharded(path, weights, shards)
    config |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _save_sharded(path: Path, weights: dict, shards: int) -> None:
    """Weights split over `shards` files with a model.safetensors.index.json, as the Hub has."""
    keys = sorted(weights)
    per = math.ceil(len(keys) / shards)
    index = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[s * per : (s + 1) * per]}
        mx.save_safetensors(str(path / name), part, metadata={"format": "pt"})
        index.update(dict.fromkeys(part, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


# ------------------------------------------------------------------ EAGLE-3 drafts

EAGLE_TARGET_LAYERS = 8  # (2, L // 2, L - 3) = (2, 4, 5): three distinct target layers


def make_eagle_target(path: str | Path, seed: int = 0) -> Path:
    """The tiny llama target the EAGLE-3 drafts below are made for (its config names its
    architecture, as a released checkpoint's does)."""
    path = make_tiny_model(path, seed=seed, layers=EAGLE_TARGET_LAYERS, scale=3.0, tie=False)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def eagle3_arrays(
    target: Path, *, draft_vocab: int | None = None, seed: int = 0, fc_norm: bool = False
) -> tuple[dict[str, mx.array], np.ndarray, dict]:
    """Random EAGLE-3 weights (the authors' names: midlayer.*) for `target`, the absolute target
    id of each draft id, and the layer config. `draft_vocab`: keep that many target ids."""
    config = json.loads((target / "config.json").read_text())
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array(rng.normal(0, scale / math.sqrt(shape[-1]), shape).astype(np.float32))

    def gain() -> mx.array:
        return mx.array((1 + 0.1 * rng.normal(size=h)).astype(np.float32))

    vd = draft_vocab or vocab
    ids = np.sort(rng.choice(vocab, size=vd, replace=False)) if vd < vocab else np.arange(vocab)
    arrays = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h, scale=2.0),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h, scale=2.0),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.hidden_norm.weight": gain(),
        "midlayer.input_layernorm.weight": gain(),
        "midlayer.post_attention_layernorm.weight": gain(),
        "norm.weight": gain(),
        "lm_head.weight": w(vd, h, scale=3.0),
    }
    if fc_norm:
        arrays.update({f"fc_norm.{k}.weight": gain() for k in range(3)})
    layer = {
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    return arrays, ids, layer


def _vocab_buffers(ids: np.ndarray, vocab: int) -> dict[str, mx.array]:
    """d2t as EAGLE's scandata writes it (target id - draft id, int64) and t2d (bool)."""
    mask = np.zeros(vocab, dtype=bool)
    mask[ids] = True
    return {"d2t": mx.array(ids - np.arange(ids.size)), "t2d": mx.array(mask)}


def make_eagle3_draft(
    path: str | Path,
    target: Path,
    fmt: str,
    *,
    draft_vocab: int | None = None,
    seed: int = 0,
    edit: Any = None,
) -> Path:
    """A tiny EAGLE-3 draft for `target` in format `fmt` ("eagle", "specforge", "speculators").
    `edit(config, arrays)` may change either before writing (tests of refused checkpoints)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arrays, ids, layer = eagle3_arrays(target, draft_vocab=draft_vocab, seed=seed)
    vocab = layer["vocab_size"]
    if ids.size < vocab:
        arrays |= _vocab_buffers(ids, vocab)
    target_cfg = json.loads((target / "config.json").read_text())
    if fmt == "eagle":  # eagle/traineagle3/config.json's schema
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **layer}
        config["draft_vocab_size"] = int(ids.size)
    elif fmt == "specforge":  # configs/llama3-8B-eagle3.json's schema
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer}
        config["draft_vocab_size"] = int(ids.size)
    else:  # speculators' Eagle3SpeculatorConfig as its converter saves it
        arrays = {k.replace("midlayer.", "layers.0."): v for k, v in arrays.items()}
        config = {
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": {"model_type": "llama", **layer},
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": str(target),
                    "architectures": target_cfg.get("architectures") or ["LlamaForCausalLM"],
                },
            },
            "draft_vocab_size": int(ids.size),
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": None,
        }
    if edit is not None:
        edit(config, arrays)
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ------------------------------------------------------------------ GGUF with nextn layers


def glm4moe_gguf(
    src: Path, out: Path, *, drop_heads: bool = False, drop: str | None = None
) -> Path:
    """Write the glm4_moe checkpoint in `src` as llama.cpp's converter does (conversion/glm.py
    @051139f5 Glm4MoeModel: block_count = layers + nextn_predict_layers, experts merged into
    ffn_*_exps, the MTP layers as blk.{L+i}.* with blk.{L+i}.nextn.*; names through gguf-py's
    map, as the converter's own map_tensor_name). `drop_heads` writes the trunk alone (what
    `--no-mtp` writes); `drop` leaves out one GGUF tensor."""
    import gguf

    from support.gguf_arch_helpers import _add, _metadata
    from support.gguf_helpers import tokenizer_metadata

    config = json.loads((src / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    heads = 0 if drop_heads else heads
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + heads)
    w = gguf.GGUFWriter(str(out), "glm4moe")
    _metadata(w, "glm4moe", {**config, "num_hidden_layers": layers + heads})
    if heads:
        w.add_nextn_predict_layers(heads)
    meta = tokenizer_metadata(src)
    # The character vocabulary has no merges, which a GGUF BPE needs: its last token becomes
    # "ab", made by one merge (the tokenizer is not what these files test).
    meta["tokenizer.ggml.tokens"][-1] = "ab"
    meta["tokenizer.ggml.merges"] = ["a b"]
    for key, value in meta.items():
        _add(w, key, value)
    merged: dict[str, dict[int, np.ndarray]] = {}
    for k, v in sorted(weights.items()):
        parts = k.split(".")
        if k.startswith("model.layers.") and int(parts[2]) >= layers + heads:
            continue
        if ".experts." in k:  # the converter merges experts: (E, out, in) per projection
            base, rest = k.split(".experts.")
            e, proj = rest.split(".", 1)
            merged.setdefault(f"{base}.experts.{proj}", {})[int(e)] = v
            continue
        if k.endswith("e_score_correction_bias"):
            k = k.replace("e_score_correction_bias", "e_score_correction.bias")
        _add_tensor(w, names, k, v, drop)
    for k, by_e in merged.items():
        _add_tensor(w, names, k, np.stack([by_e[e] for e in sorted(by_e)]), drop)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tensor(w: Any, names: Any, key: str, value: np.ndarray, drop: str | None) -> None:
    gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
    assert gname is not None, key
    if gname != drop:
        w.add_tensor(gname, value.astype(np.float32))
