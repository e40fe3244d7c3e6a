"""GGUF files that carry MTP ("nextn") layers, as llama.cpp's converter writes them for GLM-4.5
(conversion/glm.py: block_count = num_hidden_layers + nextn_predict_layers; each MTP layer is
blk.{L+i}.* with the decoder tensors under their ordinary names and
blk.{L+i}.nextn.{eh_proj,enorm,hnorm,shared_head_head,shared_head_norm,embed_tokens}).

The MTP layers are planned here into the intermediate Hugging Face-style directory under their
checkpoint names (model.layers.{L+i}.enorm.weight, ...; the decoder layer in mlx-lm's own names),
so that models/mtp_extract.py finds them there as in a safetensors checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from ..base.errors import ConvertError, ModelError

# Checkpoint name under model.layers.{n}. -> (shape given H and V); gguf-py's tensor maps turn
# them into blk.{n}.nextn.* (MODEL_TENSOR.NEXTN_*).
NEXTN = {
    "enorm.weight": lambda h, v: (h,),
    "hnorm.weight": lambda h, v: (h,),
    "eh_proj.weight": lambda h, v: (h, 2 * h),
    "shared_head.norm.weight": lambda h, v: (h,),
    "shared_head.head.weight": lambda h, v: (v, h),
    "embed_tokens.weight": lambda h, v: (v, h),
}
OPTIONAL = ("shared_head.head.weight", "embed_tokens.weight")  # copies of the model's own


def glm4moe(m: Any, c: dict) -> dict:
    """Glm4MoeModel.set_gguf_parameters (llama.cpp conversion/glm.py) read back into mlx-lm's
    glm4_moe config; the router must be sigmoid (the only gating glm4_moe implements)."""
    count, used = m.int("expert_count"), m.int("expert_used_count")
    if not 0 < used <= count <= 4096:
        raise ConvertError(f"{m.path}: implausible expert counts ({used} used of {count})")
    if m.int("expert_gating_func", 2) != 2:
        raise ConvertError(f"{m.path}: glm4moe with a non-sigmoid expert gate is not supported")
    tensors = c["_tensors"]
    return {
        "n_routed_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": m.int("expert_feed_forward_length"),
        "n_shared_experts": m.int("expert_shared_count", 1),
        "first_k_dense_replace": m.int("leading_dense_block_count", 0),
        "routed_scaling_factor": m.float("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.meta.get(f"{m.arch}.expert_weights_norm", False)),
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "partial_rotary_factor": c.get("partial_rotary_factor", 1.0),
        "rope_scaling": None,
    }


def heads(m: Any) -> int:
    """The MTP layers the file declares ({arch}.nextn_predict_layers, 0 when absent)."""
    return m.int("nextn_predict_layers", 0)


def plan_heads(
    model: Any, config: dict, tensors: dict, lookup: Callable[[str], str | None], path: Path
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (checkpoint name, shape) for every MTP tensor of the file. The block repeats
    the trunk layer whose tensors it has (a MoE layer); a missing nextn tensor (but the optional
    copies of the embedding and output head) is a ModelError naming it."""
    layers, count = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i in range(count):
        n = layers + i
        own = {t.split(".", 2)[2] for t in tensors if t.startswith(f"blk.{n}.")}
        j = next((j for j in range(layers) if own >= _suffixes(tensors, j)), None)
        if j is None:
            raise ConvertError(f"{path}: MTP block blk.{n} matches no decoder layer of the model")
        for name, param in tree_flatten(model.layers[j].parameters()):
            gname = lookup(f"model.layers.{n}.{name}")
            if gname is None:
                raise ConvertError(f"{path}: no GGUF tensor for the MTP layer's '{name}'")
            out[gname] = (f"model.layers.{n}.{name}", tuple(param.shape))
        for name, shape in NEXTN.items():
            gname = lookup(f"model.layers.{n}.{name}")
            if gname in tensors:
                out[gname] = (f"model.layers.{n}.{name}", shape(hidden, vocab))
            elif name not in OPTIONAL:
                raise ModelError(f"{path}: MTP layer {i} lacks GGUF tensor '{gname}'")
    return out


def _suffixes(tensors: dict, block: int) -> set[str]:
    return {t.split(".", 2)[2] for t in tensors if t.startswith(f"blk.{block}.")}
