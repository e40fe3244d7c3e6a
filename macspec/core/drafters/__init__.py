"""Drafters: what proposes tokens for the target to verify (base.py: the protocol they share).

REGISTRY maps each drafter's name (its `name`, as a pair's drafter kind shows it) to its class,
as llama.cpp's common/speculative.cpp maps its speculative types; `register` adds one."""

from ...base.errors import OptionError
from .base import Distribution, Drafter, Proposal
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter
from .hybrid import HybridDrafter
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import COPY_PRIORS, MATCH_BUCKETS, NgramDrafter, match_label

REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Add a drafter class under its `name`; a name another class holds is refused."""
    held = REGISTRY.setdefault(cls.name, cls)
    if held is not cls:
        raise OptionError(f"the drafter name {cls.name!r} is taken by {held.__name__}")
    return cls


def drafter_class(name: str) -> type:
    """The class registered under `name`, or OptionError naming the known ones."""
    if name not in REGISTRY:
        raise OptionError(f"no drafter {name!r}: one of {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


for _cls in (ModelDrafter, NgramDrafter, HybridDrafter, EagleDrafter, Eagle3Drafter, MtpDrafter):
    register(_cls)

__all__ = [
    "COPY_PRIORS",
    "MATCH_BUCKETS",
    "REGISTRY",
    "Distribution",
    "Drafter",
    "Eagle3Drafter",
    "EagleDrafter",
    "HybridDrafter",
    "ModelDrafter",
    "MtpDrafter",
    "NgramDrafter",
    "Proposal",
    "drafter_class",
    "match_label",
    "register",
]
