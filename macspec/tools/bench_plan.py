"""The benchmark's methods and which of them a loaded pair can run (the rest are skipped with
the reason, never imitated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.policy import COPY_FACTOR
from ..errors import OptionError
from ..pair import load
from .bench_report import BASELINE

METHODS = (
    "mlx_lm",
    "mlx_lm_spec",
    "macspec",
    "macspec_tree",
    "macspec_adaptive",
    "macspec_ngram",
    "macspec_plain",
)
_NEEDS_DRAFT = ("mlx_lm_spec", "macspec", "macspec_tree", "macspec_adaptive")
_PER_K = ("mlx_lm_spec", "macspec", "macspec_ngram")


@dataclass(frozen=True)
class Method:
    method: str
    num_draft: int = 0  # K; 0 for plain decoding
    tree_nodes: int = 0  # the most candidates of a token tree (macspec_tree, adaptive)

    @property
    def label(self) -> str:
        names = {
            "mlx_lm": "mlx-lm plain",
            "mlx_lm_spec": "mlx-lm spec",
            "macspec": "macspec",
            "macspec_tree": "macspec tree",
            "macspec_adaptive": "macspec adaptive",
            "macspec_ngram": "macspec n-gram",
            "macspec_plain": "macspec plain",
        }
        name = names[self.method]
        if self.method == "macspec_tree":
            return f"{name} depth {self.num_draft}, <={self.tree_nodes} nodes"
        if self.method in ("macspec_adaptive", "macspec_ngram"):  # adaptive K; copies run longer
            trees = f", trees<={self.tree_nodes}" if self.tree_nodes else ""
            return f"{name} K<={self.num_draft} (copies<={COPY_FACTOR * self.num_draft}{trees})"
        return f"{name} K={self.num_draft}" if self.method in _PER_K else name


def _has_drafter(pair: Any) -> bool:
    return pair.draft is not None or pair.drafter_factory is not None


def load_pairs(target: str | None, draft: str | None, methods: list[str]) -> dict[str, Any]:
    """The pairs the methods need: "model" (the draft model alone: mlx-lm's methods, macspec
    fixed K and plain), "default" (macspec's own default drafting: adaptive K) and "ngram"."""
    # drafter="model" needs a draft model: the default pair's, or the one given.
    drafter = "model" if draft is not None or target is None else None
    pairs = {"model": load(target, draft, drafter=drafter)}
    if "macspec_adaptive" in methods:
        pairs["default"] = load(target, draft)
    if "macspec_ngram" in methods:
        pairs["ngram"] = load(str(pairs["model"].target_path), drafter="ngram")
    return pairs


def plan_methods(
    methods: list[str],
    ks: list[int],
    pairs: dict[str, Any],
    trees: list[int] = (),
    adaptive_trees: int = 0,
) -> tuple[list[Method], list[dict[str, str]]]:
    """The runs to make, and the methods that cannot run here with the reason."""
    base = pairs["model"]
    why: dict[str, str] = {}
    if not _has_drafter(base):
        for name in ("mlx_lm_spec", "macspec"):
            why[name] = "no draft model loaded (use --draft)"
    elif base.draft is None:
        why["mlx_lm_spec"] = f"the draft ({base.drafter_kind}) is not a model mlx-lm runs"
    elif "recurrent" in {**base.cache_kinds, **base.draft_cache_kinds}:
        why["mlx_lm_spec"] = "mlx-lm refuses speculation on recurrent layers (ArraysCache)"
    if _has_drafter(base):
        try:
            base.check_trees()
        except OptionError as e:
            why["macspec_tree"] = str(e)
    else:
        why["macspec_tree"] = "no draft model loaded (use --draft)"
    if "default" in pairs and not _has_drafter(pairs["default"]):
        why["macspec_adaptive"] = "no draft model loaded (use --draft)"
    plan: list[Method] = []
    skipped: list[dict[str, str]] = []
    for name in methods:
        if name in why:
            skipped.append({"method": name, "reason": why[name]})
        elif name in _PER_K:
            plan += [Method(name, k) for k in ks]
        elif name == "macspec_tree":
            plan += [Method(name, max(ks), n) for n in trees]
        elif name == "macspec_adaptive":
            plan.append(Method(name, max(ks), adaptive_trees))
        else:
            plan.append(Method(name))
    if BASELINE not in methods:
        plan.insert(0, Method(BASELINE))  # every speedup is against it
    return plan, skipped
