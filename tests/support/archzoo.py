"""An architecture zoo: tiny random models built with mlx-lm's own model classes.

Every entry is an mlx-lm architecture (its `model_type`) cut down to 2-4 layers, hidden size 32,
a handful of heads and experts, and the character vocabulary of `tinymodels.write_char_tokenizer`.
Sliding windows are shorter than `make_prompt()` and layer patterns keep both kinds of layer, so
that a speculative engine meets wrapped rotating caches and recurrent states in every test.

Cache shapes an engine must not assume away: the prompt cache can be shorter than the layer
list (gemma4_text and gemma3n share K/V between layers; nemotron_h's MLP and MoE layers have no
entry), an entry can be a CacheList (falcon_h1, baichuan_m1, deepseek_v32), and two "hybrid"
models also slide (recurrent_gemma, baichuan_m1 have RotatingKVCache layers): ask
`cache_kinds()` rather than the group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from support.tinymodels import DEFAULT_CHARS, SPECIALS, write_char_tokenizer

VOCAB = len(SPECIALS) + len(DEFAULT_CHARS)
WINDOW = 8  # every sliding window; make_prompt() is always longer
H = 32  # hidden size of every model


@dataclass(frozen=True)
class Arch:
    """One zoo entry: the HF-style config and how its random weights are scaled."""

    # "full", "sliding" (RotatingKVCache layers), "hybrid" (recurrent layers) or "chunked"
    # (ChunkedKVCache layers).
    group: str
    config: dict[str, Any]
    # Applied to mlx-lm's random init so that greedy decoding depends on the context instead of
    # looping on one or two tokens; the knobs are described in `_scale_params`.
    scale: dict[str, float] = field(default_factory=dict)
    # Relative weight noise that makes a nearly-equal draft: its greedy choice matches the
    # target's on roughly 30-80% of positions.
    draft_perturb: float = 0.1


def _llama_like(**extra: Any) -> dict[str, Any]:
    cfg = {
        "hidden_size": H,
        "num_hidden_layers": 2,
        "intermediate_size": 2 * H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    cfg.update(extra)
    return cfg


_GEMMA3_TEXT = _llama_like(
    model_type="gemma3_text",
    query_pre_attn_scalar=8,
    sliding_window=WINDOW,
    sliding_window_pattern=2,
    layer_types=["sliding_attention", "full_attention"],
    rope_local_base_freq=10000.0,
)
_GEMMA4_COMMON = {
    "hidden_size": H,
    "intermediate_size": 2 * H,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "sliding_window": WINDOW,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 512,
    "final_logit_softcapping": 30.0,
}
_QWEN35_TEXT = {
    "hidden_size": H,
    "intermediate_size": 2 * H,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "type": "default",
        "mrope_section": [1, 1, 2],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": H}

ZOO: dict[str, Arch] = {
    # Full attention: a KVCache per layer (DeepSeek V3.2: a CacheList of two, with its indexer's).
    "llama": Arch("full", _llama_like(model_type="llama"), scale={"gain": 2.5}),
    "mistral": Arch(
        "full", _llama_like(model_type="mistral", tie_word_embeddings=False), scale={"gain": 2.5}
    ),
    "qwen2": Arch("full", _llama_like(model_type="qwen2"), scale={"gain": 3.0}),
    "qwen3": Arch("full", _llama_like(model_type="qwen3"), scale={"qk": 2.0, "gain": 1.5}),
    "qwen3_moe": Arch(
        "full",
        _llama_like(
            model_type="qwen3_moe",
            **_MOE,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        scale={"gain": 1.5},
        draft_perturb=0.07,
    ),
    "gemma2": Arch(
        "full",
        _llama_like(model_type="gemma2", query_pre_attn_scalar=8),
        scale={"embed": 0.3, "gain": 1.5},
    ),
    "phi3": Arch(
        "full", _llama_like(model_type="phi3", tie_word_embeddings=False), scale={"gain": 2.0}
    ),
    "olmo2": Arch(
        "full", _llama_like(model_type="olmo2", tie_word_embeddings=False), scale={"qk": 2.0}
    ),
    "granite": Arch(
        "full",
        _llama_like(
            model_type="granite",
            logits_scaling=2.0,
            attention_multiplier=0.125,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_bias=False,
            mlp_bias=False,
        ),
        scale={"gain": 4.0},
    ),
    "starcoder2": Arch(
        "full",
        _llama_like(model_type="starcoder2", norm_epsilon=1e-5),
        scale={"embed": 0.1, "gain": 3.0},
    ),
    "cohere": Arch(
        "full",
        _llama_like(model_type="cohere", layer_norm_eps=1e-5, logit_scale=0.5),
        scale={"gain": 2.5},
    ),
    "deepseek_v3": Arch(
        "full",
        _llama_like(
            model_type="deepseek_v3",
            moe_intermediate_size=H,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        ),
        scale={"zeros": 0.2, "gain": 2.5},
    ),
    "ministral3": Arch(
        "full",
        _llama_like(
            model_type="ministral3",
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "llama_4_scaling_beta": 0.1,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        scale={"gain": 2.5},
    ),
    "mistral3": Arch(
        "full",
        {
            "model_type": "mistral3",
            "text_config": _llama_like(model_type="mistral", tie_word_embeddings=False),
        },
        scale={"gain": 2.5},
    ),
    "glm4_moe": Arch(
        "full",
        _llama_like(
            model_type="glm4_moe",
            moe_intermediate_size=H,
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            n_routed_experts=4,
            routed_scaling_factor=1.0,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            rope_scaling=None,
            use_qk_norm=True,
            attention_bias=False,
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
        ),
        scale={"zeros": 0.2, "gain": 2.0},
    ),
    "deepseek_v32": Arch(
        "full",
        # DeepSeek sparse attention: an indexer keeps the top 16 keys, fewer than the prompt.
        _llama_like(
            model_type="deepseek_v32",
            moe_intermediate_size=H,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            index_head_dim=8,
            index_n_heads=2,
            index_topk=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        ),
        scale={"zeros": 0.2, "gain": 2.0},
        draft_perturb=0.03,  # the indexer's top-k choice amplifies weight noise
    ),
    "llama4": Arch(
        "chunked",
        # Chunked attention (ChunkedKVCache, chunks of 8) on 3 layers of 4, the 4th global.
        {
            "model_type": "llama4",
            "text_config": _llama_like(
                model_type="llama4_text",
                num_hidden_layers=4,
                attention_bias=False,
                attention_chunk_size=WINDOW,
                interleave_moe_layer_step=2,
                intermediate_size=H,
                intermediate_size_mlp=2 * H,
                num_local_experts=4,
                num_experts_per_tok=1,
                rope_scaling=None,
                use_qk_norm=True,
            ),
        },
        scale={"zeros": 0.2, "gain": 3.0},
    ),
    # Sliding-window layers (RotatingKVCache) next to full ones (KVCache).
    "gemma3_text": Arch("sliding", _GEMMA3_TEXT),
    "gemma4_text": Arch(
        "sliding",
        # Four layers, the last two sharing the first two's K/V as Gemma 4 E2B/E4B do: the
        # prompt cache has two entries for four layers.
        {
            "model_type": "gemma4_text",
            **_GEMMA4_COMMON,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
        },
        scale={"embed": 0.3, "gain": 1.5},
    ),
    "gpt_oss": Arch(
        "sliding",
        _llama_like(
            model_type="gpt_oss",
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=H,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
    ),
    "olmo3": Arch(
        "sliding",
        _llama_like(
            model_type="olmo3",
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
        scale={"qk": 2.0},
    ),
    "cohere2": Arch(
        "sliding",
        _llama_like(
            model_type="cohere2",
            layer_norm_eps=1e-5,
            logit_scale=0.5,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
        scale={"embed": 0.3, "gain": 1.5},
    ),
    "exaone4": Arch(
        "sliding",
        _llama_like(
            model_type="exaone4",
            rope_scaling=None,
            sliding_window=WINDOW,
            sliding_window_pattern="LG",
            layer_types=["sliding_attention", "full_attention"],
        ),
        scale={"embed": 0.3},
    ),
    "gemma3": Arch(
        "sliding",
        {"model_type": "gemma3", "vocab_size": VOCAB, "text_config": _GEMMA3_TEXT},
    ),
    "gemma4": Arch(
        "sliding",
        # The 26B-A4B shape: a MoE block beside the MLP, K equal to V on full layers.
        {
            "model_type": "gemma4",
            "vocab_size": VOCAB,
            "text_config": {
                "model_type": "gemma4_text",
                **_GEMMA4_COMMON,
                "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
                "num_kv_shared_layers": 0,
                "hidden_size_per_layer_input": 0,
                "attention_k_eq_v": True,
                "num_global_key_value_heads": 1,
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": H,
            },
        },
        scale={"embed": 0.3, "gain": 1.5},
    ),
    "gemma3n": Arch(
        "sliding",
        # AltUp, Laurel, per-layer inputs, activation sparsity and K/V shared by the last two
        # layers, as in Gemma 3n E2B/E4B.
        {
            "model_type": "gemma3n",
            "text_config": {
                "model_type": "gemma3n_text",
                "hidden_size": H,
                "num_hidden_layers": 4,
                "intermediate_size": 2 * H,
                "num_attention_heads": 2,
                "head_dim": 16,
                "rms_norm_eps": 1e-6,
                "vocab_size": VOCAB,
                "num_key_value_heads": 1,
                "num_kv_shared_layers": 2,
                "vocab_size_per_layer_input": VOCAB,
                "sliding_window": WINDOW,
                "max_position_embeddings": 512,
                "rope_local_base_freq": 10000.0,
                "rope_theta": 1000000.0,
                "final_logit_softcapping": 30.0,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
                "hidden_size_per_layer_input": 8,
                "altup_num_inputs": 4,
                "altup_coef_clip": 120.0,
                "altup_correct_scale": True,
                "altup_active_idx": 0,
                "laurel_rank": 8,
            },
        },
        scale={"embed": 0.3},
        draft_perturb=0.05,
    ),
    # Recurrent layers (ArraysCache, or CacheList of it) with or without attention layers.
    "qwen3_next": Arch(
        "hybrid",
        _llama_like(
            model_type="qwen3_next",
            **_MOE,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=H,
            mlp_only_layers=[],
            partial_rotary_factor=0.5,
            full_attention_interval=2,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_5": Arch(
        "hybrid",
        {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", **_QWEN35_TEXT}},
        scale={"gain": 1.5},
    ),
    "qwen3_5_moe": Arch(
        "hybrid",
        {
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                **_QWEN35_TEXT,
                **_MOE,
                "shared_expert_intermediate_size": H,
                "tie_word_embeddings": False,
            },
        },
    ),
    "lfm2": Arch(
        "hybrid",
        {
            "model_type": "lfm2",
            "vocab_size": VOCAB,
            "hidden_size": H,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": H,
            "block_ff_dim": 3 * H,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True,
            "rope_theta": 10000.0,
            "layer_types": ["conv", "full_attention", "conv"],
        },
        scale={"gain": 2.0},
    ),
    "lfm2_moe": Arch(
        "hybrid",
        {
            "model_type": "lfm2_moe",
            "vocab_size": VOCAB,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "moe_intermediate_size": H,
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "use_expert_bias": True,
            "num_dense_layers": 1,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "rope_theta": 10000.0,
            "layer_types": ["conv", "full_attention", "conv"],
        },
        scale={"gain": 1.5},
    ),
    "mamba2": Arch(
        "hybrid",
        {
            "model_type": "mamba2",
            "num_heads": 4,
            "head_dim": 16,
            "vocab_size": VOCAB,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "state_size": 16,
            "num_hidden_layers": 2,
            "layer_norm_epsilon": 1e-5,
            "conv_kernel": 4,
            "n_groups": 1,
            "use_bias": False,
            "use_conv_bias": True,
            "tie_word_embeddings": True,
            "time_step_limit": [0.001, 100.0],
            "time_step_rank": 4,
        },
        scale={"gain": 1.5},
    ),
    "mamba": Arch(
        "hybrid",
        {
            "model_type": "mamba",
            "vocab_size": VOCAB,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "state_size": 8,
            "num_hidden_layers": 2,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_rank": 4,
            "tie_word_embeddings": True,
        },
        scale={"gain": 2.0},
    ),
    "falcon_h1": Arch(
        "hybrid",
        # Every layer runs attention and an SSM side by side: one CacheList per layer.
        _llama_like(
            model_type="falcon_h1",
            mamba_d_ssm=2 * H,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            embedding_multiplier=1.0,
            lm_head_multiplier=1.0,
        ),
        scale={"gain": 2.0},
        draft_perturb=0.07,
    ),
    "granitemoehybrid": Arch(
        "hybrid",
        _llama_like(
            model_type="granitemoehybrid",
            layer_types=["mamba", "attention", "mamba"],
            num_hidden_layers=3,
            attention_bias=False,
            embedding_multiplier=4.0,
            attention_multiplier=0.125,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=H,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_n_groups=1,
            mamba_conv_bias=True,
            mamba_proj_bias=False,
            position_embedding_type="nope",
        ),
        scale={"gain": 3.0},
    ),
    "nemotron_h": Arch(
        "hybrid",
        # Mamba, MLP, attention, MoE: only the mamba and attention layers have a cache entry.
        {
            "model_type": "nemotron_h",
            "vocab_size": VOCAB,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 8,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M-*E",
            "moe_intermediate_size": H,
            "moe_shared_expert_intermediate_size": H,
            "n_group": 1,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
        },
        scale={"zeros": 0.2, "gain": 1.5},
    ),
    "jamba": Arch(
        "hybrid",
        _llama_like(
            model_type="jamba",
            attn_layer_offset=1,
            attn_layer_period=2,
            expert_layer_offset=1,
            expert_layer_period=2,
            mamba_d_conv=4,
            mamba_d_state=8,
            mamba_expand=2,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        scale={"gain": 2.0},
    ),
    "kimi_linear": Arch(
        "hybrid",
        _llama_like(
            model_type="kimi_linear",
            linear_attn_config={
                "kda_layers": [1],
                "full_attn_layers": [2],
                "num_heads": 4,
                "head_dim": 8,
                "short_conv_kernel_size": 4,
            },
            model_max_length=512,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=H,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            mla_use_nope=True,
            first_k_dense_replace=1,
            tie_word_embeddings=False,
        ),
    ),
    "baichuan_m1": Arch(
        "hybrid",
        # Every layer has a short convolution state and a KV cache, sliding on layer 0.
        _llama_like(
            model_type="baichuan_m1",
            sliding_window=WINDOW,
            sliding_window_layers=[0],
            conv_window=2,
            tie_word_embeddings=False,
        ),
        scale={"zeros": 1.0, "gain": 1.5},
    ),
    "recurrent_gemma": Arch(
        "hybrid",
        # RG-LRU recurrent layer, then local attention over a window (RotatingKVCache).
        _llama_like(
            model_type="recurrent_gemma",
            attention_bias=False,
            conv1d_width=4,
            logits_soft_cap=30.0,
            attention_window_size=WINDOW,
            block_types=["recurrent", "attention"],
        ),
        scale={"zeros": 0.5},
    ),
    "plamo2": Arch(
        "hybrid",
        _llama_like(
            model_type="plamo2",
            hidden_size_per_head=8,
            attention_window_size=512,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_num_heads=4,
            mamba_step=2,
            mamba_chunk_size=16,
        ),
        scale={"embed": 0.3, "gain": 1.5},
    ),
    "olmo_hybrid": Arch(
        "hybrid",
        _llama_like(
            model_type="olmo_hybrid",
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=True,
            attention_bias=False,
            layer_types=["linear_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
        scale={"gain": 1.5},
    ),
    "rwkv7": Arch(
        "hybrid",
        {
            "model_type": "rwkv7",
            "vocab_size": VOCAB,
            "hidden_size": H,
            "intermediate_size": 2 * H,
            "norm_eps": 1e-5,
            "head_dim": 8,
            "num_hidden_layers": 2,
            "a_low_rank_dim": 8,
            "v_low_rank_dim": 8,
            "gate_low_rank_dim": 8,
            "decay_low_rank_dim": 8,
        },
        scale={"zeros": 1.0, "gain": 2.0},
    ),
}

# Architectures left out, with why: none so far, every one tried builds and decodes on CPU.
SKIPPED: dict[str, str] = {}

# transformers 5 loads these model types with its own tokenizer class, which replaces the
# pre-tokenizer of tokenizer.json by a byte-level one (the char tokenizer would lose its spaces):
# they get the same ids as a byte-level BPE without merges.
BYTE_LEVEL_TOKENIZER = {"qwen2", "qwen3_5", "qwen3_5_moe"}

# Architectures whose mlx-lm forward without a cache disagrees with its cached decoding; the
# cached path is the right one there, so the reference holds (checked by test_archzoo.py).
NO_CACHE_DIFFERS: dict[str, str] = {
    "gemma3n": (
        "mlx-lm 0.32.2 gemma3n: with cache=None the KV-shared layers compute their own K/V "
        "instead of reusing the shared ones (transformers reuses them with or without a cache); "
        "recompute through a fresh prompt cache instead"
    ),
}

FULL_ATTENTION = [a for a, s in ZOO.items() if s.group == "full"]
SLIDING = [a for a, s in ZOO.items() if s.group == "sliding"]
HYBRID = [a for a, s in ZOO.items() if s.group == "hybrid"]
CHUNKED = [a for a, s in ZOO.items() if s.group == "chunked"]


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for a config, through its own model_type remapping."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def build_model(
    arch: str,
    *,
    seed: int = 0,
    perturb: float = 0.0,
    perturb_seed: int = 1,
    scale: dict[str, float] | None = None,
    config: dict[str, Any] | None = None,
) -> nn.Module:
    """The in-memory model of `arch`: what `make_arch_model` saves and `load` reads back.

    `scale` overrides the zoo's recorded multipliers (see `Arch.scale`); `perturb` adds noise of
    that size relative to each tensor's spread, drawn from `perturb_seed`; `config` replaces the
    zoo's config (e.g. a smaller vocabulary).
    """
    spec = ZOO[arch]
    config = json.loads(json.dumps(config or spec.config))  # ModelArgs may write into dicts
    model_cls, args_cls = model_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    params = _scale_params(model, params, spec.scale if scale is None else scale)
    if perturb:
        keys = mx.random.split(mx.random.key(perturb_seed), len(params))
        params = {
            k: v + perturb * mx.std(v) * mx.random.normal(v.shape, key=keys[i])
            for i, (k, v) in enumerate(sorted(params.items()))
        }
    # What load() would do to these weights (Baichuan normalises its head rows, for one).
    if hasattr(model, "sanitize"):
        params = model.sanitize(params)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def make_arch_model(
    path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    perturb: float = 0.0,
    perturb_seed: int = 1,
    scale: dict[str, float] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Save `build_model(arch, ...)` as an HF-style directory that `mlx_lm.utils.load` reads.

    config.json, model.safetensors (mlx-lm's own parameter names, float32) and the character
    tokenizer of tests/support/tinymodels.py (same ids; see `BYTE_LEVEL_TOKENIZER`).
    """
    path = Path(path)
    write_char_tokenizer(path)
    if arch in BYTE_LEVEL_TOKENIZER:
        _write_byte_level_char_tokenizer(path)
    model = build_model(
        arch, seed=seed, perturb=perturb, perturb_seed=perturb_seed, scale=scale, config=config
    )
    params = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "mlx"})
    # pad_token_id: transformers' own config classes (read when the tokenizer loads) warn when
    # their default pad id lies outside the 72-id vocabulary.
    config = {**(config or ZOO[arch].config), "bos_token_id": 1, "eos_token_id": 2}
    config["pad_token_id"] = 0
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _write_byte_level_char_tokenizer(path: Path) -> None:
    """Replace tokenizer.json by a byte-level BPE without merges: one token per character, with
    the ids of `write_char_tokenizer`, whichever pre-tokenizer transformers puts in front."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def byte_char(c: str) -> str:  # GPT-2's byte-to-unicode table, for ASCII
        return c if "!" <= c <= "~" else chr(256 + ord(c))

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in DEFAULT_CHARS:
        vocab.setdefault(byte_char(c), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))


def load_arch_model(path: str | Path) -> nn.Module:
    """The model of a zoo directory, through mlx-lm's own loader (sanitize included)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    return model


def mlx_greedy(path_or_model: str | Path | nn.Module, prompt_ids: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding of `n` tokens: generate_step with the model's prompt cache.

    The reference a speculative engine's greedy output must equal token for token.
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = path_or_model
    if not isinstance(model, nn.Module):
        model = load_arch_model(model)
    steps = generate_step(
        mx.array(prompt_ids),
        model,
        max_tokens=n,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        prompt_cache=make_prompt_cache(model),
    )
    return [int(tok) for tok, _ in steps]


def recompute_greedy(
    model: nn.Module, prompt_ids: list[int], n: int, *, fresh_cache: bool = False
) -> list[int]:
    """Greedy decoding by full recomputation: the whole sequence is run again for every token.

    With no cache at all by default; `fresh_cache` runs it through a new `make_prompt_cache`
    instead, for models whose cache-less forward is wrong (see `NO_CACHE_DIFFERS`).
    """
    from mlx_lm.models.cache import make_prompt_cache

    seq = list(prompt_ids)
    for _ in range(n):
        cache = make_prompt_cache(model) if fresh_cache else None
        logits = model(mx.array(seq)[None], cache=cache)
        seq.append(int(mx.argmax(logits[0, -1]).item()))
    return seq[len(prompt_ids) :]


def cache_kinds(model_or_arch: nn.Module | str) -> list[str]:
    """The class of every entry of the model's `make_prompt_cache`, CacheList spelled out.

    E.g. ["RotatingKVCache", "KVCache"] or ["CacheList(ArraysCache, KVCache)", ...].
    """
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    model = build_model(model_or_arch) if isinstance(model_or_arch, str) else model_or_arch

    def name(c: Any) -> str:
        if isinstance(c, CacheList):
            return f"CacheList({', '.join(name(x) for x in c.caches)})"
        return type(c).__name__

    return [name(c) for c in make_prompt_cache(model)]


def cache_classes(model_or_arch: nn.Module | str) -> set[str]:
    """The cache classes a model uses, CacheList members included (CacheList itself too)."""
    kinds = cache_kinds(model_or_arch)
    return {k.strip() for kind in kinds for k in kind.replace("(", ",").strip(")").split(",")}


def _scale_params(model: nn.Module, params: dict, scale: dict[str, float]) -> dict:
    """Multiply parts of the random init. Knobs (all default to 1, i.e. mlx-lm's own init):
    `embed` the embedding tables, `head` an untied lm_head, `qk` the q/k norms (sharper attention
    where those norms cap it), `gain` every other matrix; `zeros` replaces tensors mlx-lm
    initialises to all zeros (no bias) by noise of that std: MoE routers, RWKV-7 token shifts,
    Baichuan's K/V convolutions, RecurrentGemma's gates, which would otherwise be dead.
    """
    embeds = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    heads = {n for n, m in model.named_modules() if n.endswith("lm_head")}
    qk_norms = {n for n, _ in model.named_modules() if n.endswith(("q_norm", "k_norm"))}
    out = {}
    for k, v in params.items():
        owner = k.rsplit(".", 1)[0]
        if owner in embeds:
            f = scale.get("embed", 1.0)
        elif owner in heads:
            f = scale.get("head", 1.0)
        elif owner in qk_norms:
            f = scale.get("qk", 1.0)
        elif v.ndim >= 2:
            f = scale.get("gain", 1.0)
        else:
            f = 1.0
        if f != 1.0:
            v = v * f
        if "zeros" in scale and not k.endswith("bias") and not mx.any(v != 0).item():
            v = scale["zeros"] * mx.random.normal(v.shape)
        out[k] = v
    return out


_WORDS = "the cat sat on a mat and we ran to see it go up by his red box".split()


def make_prompt(seed: int = 0, n: int = 36) -> list[int]:
    """A deterministic prompt of `n` character ids, longer than every sliding window.

    Words drawn with repetition from a small list, so an n-gram drafter finds repeats in it.
    """
    import random

    rng = random.Random(seed)
    text = ""
    while len(text) < n:
        text += rng.choice(_WORDS) + " "
    return [len(SPECIALS) + DEFAULT_CHARS.index(c) for c in text[:n]]
