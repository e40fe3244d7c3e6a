"""Drafters: what proposes tokens for the target to verify."""

from .base import (
    COPY_PRIORS,
    MATCH_BUCKETS,
    DistFn,
    Drafter,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    Proposal,
    match_label,
    prefill,
)

__all__ = [
    "COPY_PRIORS",
    "MATCH_BUCKETS",
    "DistFn",
    "Drafter",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "match_label",
    "prefill",
]
