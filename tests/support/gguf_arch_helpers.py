"""Tiny random mlx-lm models of each architecture, saved as Hugging Face-style directories, and
written as GGUF the way llama.cpp's convert_hf_to_gguf.py writes them: its metadata keys, its
tensor names (a table written here by hand, independent of the converter's use of gguf's maps),
Q/K rows permuted for the llama family, +1 on Gemma's norm weights, experts already stacked.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from support.gguf_helpers import bpe_tokenizer, gguf_name, permute, tokenizer_metadata

BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}  # a multiple of 32 quantizes
# name -> (GGUF architecture, mlx-lm config); each exercises what its family stores differently
CASES = {
    "llama": ("llama", {"model_type": "llama", "attention_bias": True}),
    "mistral": ("llama", {"model_type": "llama", "rope_theta": 1e6, "num_key_value_heads": 1}),
    "mixtral": ("llama", {"model_type": "mixtral", "num_local_experts": 4, **MOE}),
    "qwen2": ("qwen2", {"model_type": "qwen2", "tie_word_embeddings": True}),
    "qwen2moe": (
        "qwen2moe",
        {"model_type": "qwen2_moe", "num_experts": 4, "shared_expert_intermediate_size": 24, **MOE},
    ),
    "qwen3": ("qwen3", {"model_type": "qwen3", "head_dim": 16}),
    "qwen3-yarn": (
        "qwen3",
        {
            "model_type": "qwen3",
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
        },
    ),
    "qwen3moe": (
        "qwen3moe",
        {
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            **MOE,
        },
    ),
    # GemmaModel writes no rope base: llama.cpp's default (10000, Gemma's) applies
    "gemma": ("gemma", {"model_type": "gemma", "head_dim": 16, "rope_theta": 10000.0}),
    "gemma2": (
        "gemma2",
        {
            "model_type": "gemma2",
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "gemma3",
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 3,
            "query_pre_attn_scalar": 8,
            "sliding_window": 4,
            "sliding_window_pattern": 3,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"type": "linear", "factor": 4.0},
        },
    ),
    "phi3": ("phi3", {"model_type": "phi3", "partial_rotary_factor": 0.5}),
    "phi3-longrope": (
        "phi3",
        {
            "model_type": "phi3",
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 16,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 2.0, 4.0],
                "short_factor": [1.0, 1.1, 1.2, 1.3],
            },
        },
    ),
    "olmo2": ("olmo2", {"model_type": "olmo2"}),
    "starcoder2": ("starcoder2", {"model_type": "starcoder2", "norm_epsilon": 1e-5}),
    # GLM-4.5: sigmoid-routed experts after one dense layer, q/k/v biases, half-rotary heads
    "glm4moe": (
        "glm4moe",
        {
            "model_type": "glm4_moe",
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_scaling": None,
            **MOE,
        },
    ),
}
GEMMA = {"gemma", "gemma2", "gemma3"}


def make_model(path: Path, case: str, seed: int = 0) -> Path:
    """A tiny random model of `case` with the byte-level BPE tokenizer, in an HF-style directory
    that mlx-lm loads; weights are scaled so that every part matters to the logits."""
    _, extra = CASES[case]
    n = bpe_tokenizer(path)
    config = {**BASE, **extra, "vocab_size": n, "bos_token_id": 1, "eos_token_id": 2}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = {}
    for k, v in tree_flatten(model.parameters()):
        noise = mx.random.normal(v.shape)
        if "norm" in k and k.endswith("weight"):
            # Gemma's norms are stored as w - 1 (the model adds 1); others multiply by w
            base = 0.0 if case in GEMMA else 1.0
            params[k] = base + 0.2 * noise
        elif "embed" in k:
            params[k] = 2.0 * noise
        else:
            params[k] = 0.3 * noise
    if case in GEMMA:
        params.pop("lm_head.weight", None)  # Gemma ties its output head
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _metadata(w: gguf.GGUFWriter, case: str, c: dict) -> None:
    """convert_hf_to_gguf.py's set_gguf_parameters for each of these architectures."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if case == "starcoder2":
        w.add_layer_norm_eps(c["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if case != "gemma":  # GemmaModel writes no rope base (llama.cpp's default 10000 applies)
        w.add_rope_freq_base(c["rope_theta"])
    if case in ("llama", "mistral", "mixtral"):
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c["head_dim"])
    if "num_experts_per_tok" in c:
        w.add_expert_count(
            c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]
        )
        w.add_expert_used_count(c["num_experts_per_tok"])
    if case == "glm4moe":  # conversion/glm.py Glm4MoeModel.set_gguf_parameters
        w.add_rope_dimension_count(int(c["head_dim"] * c["partial_rotary_factor"]))
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
    if case in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if case == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if case == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(4096)
    if case == "gemma3":
        w.add_sliding_window(c["sliding_window"])
        w.add_rope_freq_base_swa(c["rope_local_base_freq"])
        w.add_uint32("gemma3.attention.sliding_window_pattern", c["sliding_window_pattern"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    if case == "qwen3-yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
        w.add_rope_scaling_orig_ctx_len(c["rope_scaling"]["original_max_position_embeddings"])
    if case.startswith("phi3"):
        rotary = (
            int(c.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]
        )
        w.add_rope_dimension_count(rotary)
        w.add_rope_scaling_orig_ctx_len(c.get("original_max_position_embeddings", 4096))
        w.add_sliding_window(0)
    if case == "phi3-longrope":
        scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(c["original_max_position_embeddings"]))
        )


def hf_to_gguf(
    src: Path, out: Path, case: str, qtype: str = "F32", raw: dict | None = None
) -> None:
    """Write the model in `src` as llama.cpp's converter would (2-D weights in `qtype`, or as the
    given raw blocks: `raw` maps a weight name to (type name, bytes))."""
    arch, _ = CASES[case]
    config = json.loads((src / "config.json").read_text())
    weights = {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    _metadata(w, case, config)
    for key, value in tokenizer_metadata(src).items():
        _add(w, key, value)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, a in weights.items():
        if case in ("llama", "mistral", "mixtral"):  # LlamaModel.permute, weights and biases
            if ".q_proj." in name:
                a = permute(a, config["num_attention_heads"])
            elif ".k_proj." in name:
                a = permute(a, config["num_key_value_heads"])
        if case in GEMMA and name.endswith("norm.weight"):
            a = a + 1  # Gemma's converters store the multiplier the RMSNorm applies
        target = gguf_name(name, case)
        if raw and name in raw:
            w.add_tensor(target, raw[name][1], raw_dtype=gguf.GGMLQuantizationType[raw[name][0]])
        elif a.ndim >= 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(target, a.astype(np.float32))
    if case == "phi3-longrope":
        scaling = config["rope_scaling"]
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)
