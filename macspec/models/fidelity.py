"""How far a model's next-token distributions are from a reference's on the same ids: mean /
median / p99 KL and top-1 agreement, as llama.cpp's `llama-perplexity --kl-divergence` reports,
and perplexity. `macspec eval` prints it; `convert -q 4|8` of a GGUF measures what requantizing
cost against the file's blocks kept (`measure_requantized`).

Teacher-forced in windows of `context` ids, each from an empty cache; the first `skip` positions
of every window are not scored (they see almost no context, as llama-perplexity scores only a
window's second half). KL(reference || model) = sum p_ref (log p_ref - log p_model), in nats.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..base import logs
from ..base.errors import MacspecError, ModelError, OptionError
from ..core import hooks
from ..cpu import install_default
from .store import DATA

log = logging.getLogger("macspec.models")

# A few paragraphs of prose and code written for this (no model has trained on them): what
# convert scores a requantized model on.
SAMPLE = DATA / "fidelity-sample.txt"


@dataclass(frozen=True)
class Scores:
    """Per scored position: the model's log-probability of the next id, and against a
    reference its KL and whether both put the same id first (None without a reference)."""

    nll: np.ndarray  # (P,) -log p_model(next id)
    ref_nll: np.ndarray | None = None
    kl: np.ndarray | None = None  # (P,) nats
    same_top: np.ndarray | None = None  # (P,) bool


@dataclass(frozen=True)
class Report:
    positions: int
    perplexity: float
    reference_perplexity: float | None = None
    kl_mean: float | None = None
    kl_median: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None

    @staticmethod
    def of(s: Scores) -> Report:
        ppl = float(math.exp(s.nll.mean()))
        if s.kl is None:
            return Report(len(s.nll), ppl)
        return Report(
            len(s.nll),
            ppl,
            float(math.exp(s.ref_nll.mean())),
            float(s.kl.mean()),
            float(np.median(s.kl)),
            float(np.percentile(s.kl, 99)),
            float(s.kl.max()),
            float(s.same_top.mean()),
        )

    def table(self) -> str:
        rows = [("scored positions", f"{self.positions}"), ("perplexity", f"{self.perplexity:.4f}")]
        if self.kl_mean is not None:
            rows += [
                ("reference perplexity", f"{self.reference_perplexity:.4f}"),
                ("mean KL(reference || model), nats", f"{self.kl_mean:.6f}"),
                ("median KL", f"{self.kl_median:.6f}"),
                ("p99 KL", f"{self.kl_p99:.6f}"),
                ("max KL", f"{self.kl_max:.6f}"),
                ("top-1 agreement", f"{self.top1_agreement:.4f}"),
            ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v:>12}" for k, v in rows)


def windows(ids: list[int], context: int, skip: int) -> list[list[int]]:
    """The ids cut into windows of `context` (the last one shorter), each long enough to score."""
    out = [ids[i : i + context] for i in range(0, len(ids), context)]
    return [w for w in out if len(w) > skip + 1]


def _log_probs(model: nn.Module, window: list[int]) -> mx.array:
    """(L, V) float32 log-softmax of a model's logits over `window`, from an empty cache."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(window)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def score(
    model: nn.Module,
    ids: list[int],
    reference: nn.Module | None = None,
    context: int = 512,
    skip: int = 4,
) -> Scores:
    """Teacher-forced scores of `model` (and against `reference`) over `ids`; progress notes."""
    parts: dict[str, list[np.ndarray]] = {"nll": [], "ref_nll": [], "kl": [], "same_top": []}
    chunks = windows(ids, context, skip)
    if not chunks:
        raise OptionError(f"the text gives {len(ids)} ids: too few to score (more than {skip + 1})")
    start = time.perf_counter()
    for n, w in enumerate(chunks, 1):
        nxt = mx.array(w[skip + 1 :])
        lp = _log_probs(model, w)[skip:-1]
        parts["nll"].append(np.array(-mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]))
        if reference is not None:
            rp = _log_probs(reference, w)[skip:-1]
            if rp.shape != lp.shape:
                raise ModelError(
                    f"the reference gives {rp.shape[-1]} logits a position, the model "
                    f"{lp.shape[-1]}: not the same vocabulary"
                )
            kl = mx.sum(mx.exp(rp) * (rp - lp), axis=-1)
            parts["ref_nll"].append(np.array(-mx.take_along_axis(rp, nxt[:, None], axis=-1)[:, 0]))
            parts["kl"].append(np.maximum(np.array(kl), 0.0))  # rounding can give -1e-9
            parts["same_top"].append(np.array(mx.argmax(rp, -1) == mx.argmax(lp, -1)))
        spent = time.perf_counter() - start
        logs.progress(
            log,
            f"window {n}/{len(chunks)}, {spent:.0f} s, about "
            f"{spent / n * (len(chunks) - n):.0f} s left",
        )
    got = {k: np.concatenate(v) if v else None for k, v in parts.items()}
    return Scores(**got)


def load_model(path: Path) -> tuple[nn.Module, object]:
    """(model, tokenizer) of a model directory as macspec runs it (the backend's kernels)."""
    from mlx_lm.utils import load as mlx_load

    install_default()  # as macspec.load does (api/loading.py)
    try:
        model, tokenizer = mlx_load(str(path))
    except MacspecError:
        raise
    except Exception as e:  # mlx-lm raises ValueError/KeyError/RuntimeError from deep inside
        raise ModelError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    hooks.accelerate_model(model)
    return model, tokenizer


def measure_requantized(gguf: Path, converted: Path, scratch: Path, max_ids: int = 512) -> Report:
    """KL and top-1 agreement of `converted` (a -q 4|8 conversion of `gguf`) against the file's
    blocks kept (-q keep, the default conversion, written into `scratch` and removed), on
    SAMPLE's first `max_ids` ids. Kept blocks stand in for the file decoded to float32 at a
    quarter of its memory; on the real pair they are 0.0004 nats from it (docs/models.md)."""
    from .gguf import gguf_to_hf

    model, tokenizer = load_model(converted)
    ids = tokenizer.encode(SAMPLE.read_text(encoding="utf-8"))[:max_ids]
    logs.progress(log, f"measuring what requantizing cost: against {gguf.name}'s blocks kept")
    try:
        gguf_to_hf(gguf, scratch, dtype="float32", keep=True, scales="float32")
        reference, _ = load_model(scratch)
        mx.eval(reference.parameters())  # read before the directory goes
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Report.of(score(model, ids, reference, context=max_ids))
