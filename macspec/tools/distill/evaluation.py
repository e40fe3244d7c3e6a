"""Measuring a distilled draft: held-out top-1 agreement while training, then acceptance and
speed end to end on the built-in benchmark prompts (never trained on), written to report.json.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from ...api.stream import acceptance_by_position, generate, prompt_ids
from ...base.errors import MacspecError
from ..prompts import builtin_prompts
from .data import Dataset
from .progress import bar, end_bar
from .training import params, unrolled


def agreement(draft: Any, parts: Any, data: Dataset, rows: list[int], unroll: int = 2) -> list:
    """Top-1 agreement with the target on `rows`, for the first draft token (real features) and
    the following ones (own predicted features): an estimate of per-position greedy acceptance."""
    out = []
    for k in range(0, len(rows), 16):
        feats, nxt, target, where = data.batch(rows[k : k + 16])
        h = target.shape[-1]
        embeds = parts.embed(nxt)
        best = mx.argmax(target.reshape(-1, h)[where] @ parts.head.T, axis=-1)
        for step, pred in enumerate(unrolled(draft, draft.state(feats), embeds, unroll)):
            state = pred.reshape(-1, pred.shape[-1])[where]
            hit = (mx.argmax(draft.logits(state, parts.head), axis=-1) == best).sum()
            if len(out) <= step:
                out.append([0.0, 0.0])
            out[step][0] += hit.item()
            out[step][1] += where.size
    return [round(a / max(n, 1), 4) for a, n in out]


def evaluate(
    pair: Any,
    *,
    max_tokens: int = 96,
    num_draft: int = 4,
    seed: int = 0,
    temperatures: tuple[float, ...] = (0.0, 0.7),
    progress: bool = True,
) -> dict:
    """Acceptance on the built-in benchmark prompts (held out from training) at fixed K, and the
    end-to-end speed against plain decoding on the chat prompts at temperature 0."""
    prompts = []
    for p in builtin_prompts():
        ids = prompt_ids(pair, messages=p.messages)
        if len(ids) + max_tokens < pair.context_length:
            prompts.append((p.kind, ids))
    if not prompts:
        raise MacspecError("no evaluation prompt fits the target's context")
    report: dict[str, Any] = {"num_draft": num_draft, "max_tokens": max_tokens, "prompts": {}}
    total = len(prompts) * len(temperatures) + 3 * sum(k == "chat" for k, _ in prompts)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            bar("eval", done, total, "")

    for t in temperatures:
        by_kind: dict[str, list] = {}
        for kind, ids in prompts:
            r = generate(
                pair,
                ids,
                max_tokens=max_tokens,
                temperature=t,
                num_draft=num_draft,
                adaptive=False,
                seed=seed,
            )
            by_kind.setdefault(kind, []).append(r.stats)
            by_kind.setdefault("all", []).append(r.stats)
            tick()
        report[f"temperature_{t:g}"] = {k: _summary(v) for k, v in by_kind.items()}
    chat = [ids for kind, ids in prompts if kind == "chat"]
    speed = measure_speed(
        pair, chat, max_tokens=max_tokens, num_draft=num_draft, seed=seed, tick=tick
    )
    if progress:
        end_bar()
    report["speed_chat_temperature_0"] = speed
    report["prompts"] = {k: sum(kind == k for kind, _ in prompts) for k, _ in prompts}
    return report


SPEED_MODES = (
    ("plain", {"speculative": False}),
    ("fixed_k", {"adaptive": False}),
    ("adaptive_k", {"adaptive": True}),
)


def measure_speed(
    pair: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int = 96,
    num_draft: int = 4,
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,
) -> dict:
    """Tokens/s of plain decoding, fixed K and adaptive K at temperature 0 on `prompts`.

    The three modes run back to back on each prompt, so a change in machine load (a shared CPU)
    hits them alike rather than one whole mode."""
    stats: dict[str, list] = {label: [] for label, _ in SPEED_MODES}
    for ids in prompts:
        for label, opts in SPEED_MODES:
            r = generate(pair, ids, max_tokens=max_tokens, num_draft=num_draft, seed=seed, **opts)
            stats[label].append(r.stats)
            tick()
    speed: dict[str, Any] = {}
    for label, _ in SPEED_MODES:
        tokens = sum(s.generated_tokens for s in stats[label])
        seconds = sum(s.total_time for s in stats[label])
        speed[label] = {"tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0}
        if label != "plain":
            speed[label].update(_summary(stats[label]))
    base = speed["plain"]["tokens_per_second"]
    for label in ("fixed_k", "adaptive_k"):
        speed[label]["speedup"] = round(speed[label]["tokens_per_second"] / base, 3) if base else 0
    return speed


def _summary(stats: list) -> dict:
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    rounds = sum(s.speculative_rounds for s in stats)
    emitted = sum(s.mean_accepted_length * s.speculative_rounds for s in stats)
    draft_time = sum(s.draft_time for s in stats)
    plain = [s.plain_step_time for s in stats if s.plain_step_time]
    by_position = acceptance_by_position((s.drafted_at, s.accepted_at) for s in stats)
    out = {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(emitted / rounds, 3) if rounds else 1.0,
        # P(the draft at position i accepted | drafted), over every answer's rounds
        "acceptance_by_position": [round(a, 4) for a in by_position],
        "drafted": drafted,
    }
    if drafted and plain:
        # Seconds per drafted token over seconds per plain target step.
        out["draft_step_cost"] = round(draft_time / drafted / (sum(plain) / len(plain)), 4)
    return out


def summarise(report: dict) -> dict:
    """The headline figures (what `macspec models` shows): chat prompts, K=4."""
    ev = report["evaluation"]
    speed = ev["speed_chat_temperature_0"]
    out = {}
    for t in ("0", "0.7"):
        chat = ev[f"temperature_{t}"].get("chat") or ev[f"temperature_{t}"]["all"]
        out[f"acceptance_rate_t{t}"] = chat["acceptance_rate"]
        out[f"mean_accepted_length_t{t}"] = chat["mean_accepted_length"]
    out["speedup_t0"] = speed["adaptive_k"]["speedup"]
    return out


def headline(report: dict) -> str:
    """The evaluation in one line for the terminal: acceptance at fixed K and T=0 by kind of
    prompt (and by draft position), and adaptive K's speed against plain on the chat prompts."""
    ev = report["evaluation"]
    kinds = []
    for kind, s in ev["temperature_0"].items():
        if kind != "all":
            by_position = ", ".join(f"{a:.0%}" for a in s["acceptance_by_position"])
            kinds.append(f"{kind} {s['acceptance_rate']:.1%} ({by_position})")
    speed = ev["speed_chat_temperature_0"]["adaptive_k"]["speedup"]
    return (
        f"accepted at K={ev['num_draft']}, T=0 (by position): {'; '.join(kinds)}; "
        f"adaptive K on chat {speed:.2f}x plain (report.json has the rest)"
    )


def coverage(data: Dataset, vocab_ids: list[int]) -> float:
    """Share of the sampled answer ids that the draft's vocabulary contains."""
    keep = np.zeros(max(vocab_ids) + 1, bool)
    keep[vocab_ids] = True
    ids = np.concatenate([i[f + 2 :] for i, f in zip(data.ids, data.first, strict=True)])
    return round(float(keep[np.minimum(ids, len(keep) - 1)].mean()), 4) if ids.size else 0.0


def draft_report(
    pair: Any,
    draft: Any,
    data: Dataset,
    vocab_ids: list[int],
    *,
    facts: dict,
    eval_tokens: int,
    seed: int,
    progress: bool = True,
) -> dict:
    """report.json: the run's `facts` (init, data, training, agreement), the vocabulary's
    coverage, the draft's size and the end-to-end evaluation, headed by the summary."""
    report = {
        "kind": facts.get("kind", "eagle"),
        "target": pair.target_path.name,
        "init": facts["init"],
        "data": {"tokens": data.tokens(), "rows": len(data), **facts["data"]},
        "vocab": {"size": len(vocab_ids), "coverage": coverage(data, vocab_ids)},
        "training": facts["training"],
        "agreement_top1_by_position": facts["agreement"],
        "parameters": sum(v.size for _, v in params(draft)),
        "evaluation": evaluate(pair, max_tokens=eval_tokens, seed=seed, progress=progress),
    }
    return {"summary": summarise(report), **report}
