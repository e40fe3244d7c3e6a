"""The backend-neutral speculative core: it runs the same on Metal, CUDA and a CPU, imports only
mlx, mlx-lm, numpy and the project's errors and switches, and reads no file and prints nothing.

    loop.py       the generation loop: one Round per target pass (generate_rounds)
    round.py      one round, written once: draft, verify, accept, commit or undo
    target.py     the target's passes, hidden states and rewinds
    verify.py     the acceptance rule, a plain step's draw
    sampling.py   one distribution for draft and target
    tree.py       token trees: drafted by level, verified in one pass, walked exactly
    policy.py     the Policy protocol, measured costs, fixed K (and trees)
    adaptive.py   adaptive K (and trees), priced by measured costs and acceptance
    observed.py   the adaptive choice checked against the round times this run observes
    tally.py      the policy's decaying tally, back-off schedule and decision (with its reason)
    measure.py    what a step, a draft token and a K-wide pass cost here
    sharded.py    a target sharded over mlx.launch ranks
    memory.py     Metal hygiene: wired memory while generating, the buffer cache emptied
    hooks.py      what an accelerator may replace (plain mlx by default)
    loaded.py     what the core needs of a loaded pair
    drafters/     draft model, n-gram copy, both combined, the EAGLE feature draft; a registry
    caches/       exact rewinds for every layer kind, and the prompt cache

This module is the interface pair.py and api.py use.
"""

from . import caches, hooks, policy
from .adaptive import AdaptiveK, adaptive
from .caches import PromptCache
from .drafters import (
    REGISTRY,
    Drafter,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    drafter_class,
    register,
)
from .loaded import LoadedPair
from .loop import Engine, Limits, Round, Sampling, Timing, generate_rounds
from .measure import calibrate
from .observed import Observations, Observed
from .policy import Costs, FixedK, FixedTree
from .sampling import SamplingOptions
from .sharded import guard, load_sharded, make_target
from .tree import TreeShape

__all__ = [
    "REGISTRY",
    "AdaptiveK",
    "Costs",
    "Drafter",
    "Engine",
    "FixedK",
    "FixedTree",
    "HybridDrafter",
    "Limits",
    "LoadedPair",
    "ModelDrafter",
    "NgramDrafter",
    "Observations",
    "Observed",
    "PromptCache",
    "Round",
    "Sampling",
    "SamplingOptions",
    "Timing",
    "TreeShape",
    "adaptive",
    "caches",
    "calibrate",
    "drafter_class",
    "generate_rounds",
    "guard",
    "hooks",
    "load_sharded",
    "make_target",
    "policy",
    "register",
]
