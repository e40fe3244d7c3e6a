"""The benchmark's methods, which of them a loaded pair can run (the rest are skipped with the
reason, never imitated), and the baseline the speedups are against."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...api.pair import DRAFT_CONTEXT, load, share
from ...base.errors import OptionError
from ...core.policy import COPY_FACTOR
from ...cpu import kernels
from ...models import mtp
from ..prompts import KINDS, Prompt, builtin_prompts, load_prompts
from .llamacpp import LLAMACPP

METHODS = (
    "mlx_lm",
    "mlx_lm_spec",
    "macspec",
    "macspec_tree",
    "macspec_adaptive",
    "macspec_ngram",
    "macspec_mtp",
    "macspec_plain",
    *LLAMACPP,
)
DEFAULT_METHODS = tuple(m for m in METHODS if m not in LLAMACPP)  # llama.cpp's: opt-in, a peer
_NEEDS_DRAFT = ("mlx_lm_spec", "macspec", "macspec_tree", "macspec_adaptive")
_PER_K = ("mlx_lm_spec", "macspec", "macspec_ngram", "macspec_mtp", "llamacpp_draft")
MLX_LM = ("mlx_lm", "mlx_lm_spec")
# mlx-lm's stock models are the reference where they run at a usable speed (its 4-bit products
# on a CPU can take minutes a prompt): past this many seconds a prompt its rows are opt-in.
OPT_IN_SECONDS = 60.0


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
            "macspec_mtp": "macspec mtp",
            "macspec_plain": "macspec plain",
            "llamacpp_plain": "llama.cpp plain",
            "llamacpp_draft": "llama.cpp draft",
            "llamacpp_ngram": "llama.cpp n-gram",
        }
        name = names[self.method]
        if self.method == "llamacpp_draft" and not self.num_draft:
            return f"{name} (its defaults)"
        if self.method == "macspec_tree":
            return f"{name} depth {self.num_draft}, <={self.tree_nodes} nodes"
        if self.method in ("macspec_adaptive", "macspec_ngram"):  # adaptive K; copies run longer
            trees = f", trees<={self.tree_nodes}" if self.tree_nodes else ""
            return f"{name} K<={self.num_draft} (copies<={COPY_FACTOR * self.num_draft}{trees})"
        return f"{name} K={self.num_draft}" if self.method in _PER_K else name


def parse_numbers(value: Any, name: str, cast: type, minimum: float, example: str) -> list:
    """A comma-separated string, one number or a sequence, as a list of `cast` >= `minimum`."""
    kind = "integers" if cast is int else "numbers"
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (int, float)):
        items = [value]
    else:
        items = list(value)
    try:
        out = [cast(x) for x in items]
        if any(float(x) != y for x, y in zip(items, out, strict=True)):
            raise ValueError  # 2.5 is not an integer: refuse rather than truncate
    except ValueError:
        raise OptionError(f"invalid {name}={value!r}: expected {kind} like {example}") from None
    if not out or any(x < minimum for x in out):
        raise OptionError(f"invalid {name}={value!r}: expected {kind} >= {minimum}")
    return out


def parse_names(value: str | Sequence[str] | None, allowed: Sequence[str], name: str) -> list[str]:
    if value is None:
        return list(allowed)
    items = [x.strip() for x in value.split(",")] if isinstance(value, str) else list(value)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise OptionError(f"invalid {name}={value!r}: choose from {', '.join(allowed)}")
    return items


def select_prompts(prompts: str, kinds: str | Sequence[str] | None, per_kind: int) -> list[Prompt]:
    """The built-in prompts or a file's, of the chosen kinds, `per_kind` of each (0: all)."""
    if prompts == "builtin":
        return builtin_prompts(parse_names(kinds, KINDS, "kinds"), per_kind)
    found = load_prompts(prompts)
    wanted = parse_names(kinds, sorted({p.kind for p in found}), "kinds") if kinds else None
    found = [p for p in found if wanted is None or p.kind in wanted]
    if per_kind > 0:
        found = [
            p for i, p in enumerate(found) if sum(q.kind == p.kind for q in found[:i]) < per_kind
        ]
    return found


def _has_drafter(pair: Any) -> bool:
    return pair.draft is not None or pair.drafter_factory is not None


def load_pairs(
    target: str | None, draft: str | None, methods: list[str], draft_context: int = DRAFT_CONTEXT
) -> dict[str, Any]:
    """The pairs the methods need: "model" (the draft model alone: mlx-lm's methods, macspec
    fixed K and plain), "default" (macspec's own default drafting: adaptive K) and "ngram".
    Each adaptive pair measures its costs in the warm-up, not at load: only the pairs a method
    uses pay for it. `draft_context`: the ids of a prompt's end a draft model reads (load())."""
    # drafter="model" needs a draft model: the default pair's, or the one given.
    drafter = "model" if draft is not None or target is None else None
    pair = load(target, draft, drafter=drafter, measure=False, draft_context=draft_context)
    pairs = {"model": pair}
    # The other pairs share the loaded models: one copy of the weights in memory, not three.
    if "macspec_adaptive" in methods:
        pairs["default"] = share(pairs["model"], None)
    if "macspec_ngram" in methods:
        pairs["ngram"] = share(pairs["model"], "ngram")
    if "macspec_mtp" in methods and mtp.summary(Path(pairs["model"].target_path)) is not None:
        pairs["mtp"] = share(pairs["model"], "mtp")
    return pairs


def mlx_lm_step(pair: Any, ids: list[int]) -> float:
    """Seconds one decoding step of mlx-lm's own (stock) target takes after the prompt `ids`."""
    from mlx_lm.generate import generate_step

    with kernels.stock(pair.target):
        steps = generate_step(mx.array(ids, mx.uint32), pair.target, max_tokens=4)
        try:
            next(steps)  # prefill and the first token
            start = time.perf_counter()
            next(steps)
            next(steps)
            return (time.perf_counter() - start) / 2
        finally:
            steps.close()


def opt_in_reason(step: float, max_tokens: int) -> str | None:
    """Why mlx-lm's rows are left out of a default run, or None where they run quickly enough."""
    estimate = step * max_tokens
    if estimate <= OPT_IN_SECONDS:
        return None
    return (
        f"opt-in here: one mlx-lm step of this target takes {step:.2f} s, about {estimate:.0f} s "
        f"a prompt of {max_tokens} tokens (> {OPT_IN_SECONDS:.0f} s); name it in --methods"
    )


def baseline(plan: list[Method]) -> str | None:
    """The method speedups are against: mlx-lm's plain decoding when it ran, else macspec's."""
    ran = {m.method for m in plan}
    return next((b for b in ("mlx_lm", "macspec_plain") if b in ran), None)


def plan_methods(
    methods: list[str],
    ks: list[int],
    pairs: dict[str, Any],
    trees: list[int] = (),
    adaptive_trees: int = 0,
    unavailable: dict[str, str] | None = None,
) -> tuple[list[Method], list[dict[str, str]]]:
    """The runs to make, and the methods that cannot run here with the reason (`unavailable`:
    reasons found elsewhere, e.g. llama.cpp's)."""
    base = pairs["model"]
    why: dict[str, str] = dict(unavailable or {})
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
    if "mtp" not in pairs:
        why["macspec_mtp"] = (
            "the target carries no MTP heads (`macspec convert` keeps a model's own)"
        )
    plan: list[Method] = []
    skipped: list[dict[str, str]] = []
    for name in methods:
        if name in why:
            skipped.append({"method": name, "reason": why[name]})
        elif name in _PER_K:
            plan += [Method(name, k) for k in ks]
            if name == "llamacpp_draft":
                plan.append(Method(name, 0))  # and with llama.cpp's own draft settings
        elif name == "macspec_tree":
            plan += [Method(name, max(ks), n) for n in trees]
        elif name == "macspec_adaptive":
            plan.append(Method(name, max(ks), adaptive_trees))
        else:
            plan.append(Method(name))
    return plan, skipped
