"""`macspec eval`: a model's perplexity on a text, and with a reference model how far its next-token
distributions are from the reference's on the same ids (mean / median / p99 KL, top-1 agreement),
as llama.cpp's `llama-perplexity --kl-divergence` reports.

Teacher-forced in windows of `context` ids, each from an empty cache; the first `skip` positions
of every window are not scored (they see almost no context, as llama-perplexity scores only a
window's second half). KL(reference || model) = sum p_ref (log p_ref - log p_model), in nats.
Both models read the same ids: the model's tokenizer encodes the text, and a reference whose
tokenizer differs is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import logs
from ..errors import ModelError, OptionError

log = logging.getLogger("macspec.tools")


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


def _log_probs(model, window: list[int]) -> mx.array:
    """(L, V) float32 log-softmax of a model's logits over `window`, from an empty cache."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(window)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def score(model, ids: list[int], reference=None, context: int = 512, skip: int = 4) -> Scores:
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


def _load(name: str):
    """(model, tokenizer) of a store name, a model directory or a GGUF file (decoded to float32
    in a temporary directory: its exact weights)."""
    from .. import pair as pairs
    from ..models.gguf import gguf_to_hf, is_gguf

    path = Path(name).expanduser()
    if path.is_file() and is_gguf(path):
        with tempfile.TemporaryDirectory(prefix="macspec-eval-") as tmp:
            logs.progress(log, f"decoding {path} to float32 (the file's exact weights)")
            gguf_to_hf(path, Path(tmp), dtype="float32")
            loaded = pairs.load(tmp, drafter="ngram", measure=False)
            mx.eval(loaded.target.parameters())  # read before the directory goes
            return loaded.target, loaded.tokenizer
    loaded = pairs.load(name, drafter="ngram", measure=False)
    return loaded.target, loaded.tokenizer


def _read_text(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OptionError(f"{path}: cannot read the text ({e})") from e
    if not text.strip():
        raise OptionError(f"{path}: holds no text")
    return text


def evaluate(
    model: str,
    text_file: str,
    reference: str | None = None,
    context: int = 512,
    skip: int = 4,
    max_ids: int | None = None,
) -> Report:
    """Perplexity of `model` on the text in `text_file`, and its distance from `reference`."""
    if context < skip + 2 or skip < 0:
        raise OptionError(f"--context {context} must exceed --skip {skip} by at least 2")
    text = _read_text(text_file)
    target, tokenizer = _load(model)
    ids = tokenizer.encode(text)[: max_ids or None]
    ref = None
    if reference is not None:
        ref, ref_tok = _load(reference)
        if ref_tok.encode(text)[: len(ids)] != ids:
            raise ModelError(f"{reference}: its tokenizer reads the text as other ids than {model}")
    return Report.of(score(target, ids, ref, context, skip))


def _run(args: argparse.Namespace) -> int:
    report = evaluate(args.model, args.text, args.reference, args.context, args.skip, args.max_ids)
    print(json.dumps(asdict(report), indent=2) if args.json else report.table())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="perplexity on a text, and KL / top-1 agreement against a reference model",
        description="Teacher-forced perplexity of MODEL on a text file; with --reference, how far "
        "its next-token distributions are from the reference's on the same ids (as llama.cpp's "
        "llama-perplexity --kl-divergence). The natural reference for a converted GGUF is the "
        "GGUF file itself, decoded to float32.",
    )
    p.add_argument("model", help="store name or model directory")
    p.add_argument("text", help="a UTF-8 text file")
    p.add_argument("--reference", help="store name, model directory or GGUF file")
    p.add_argument("--context", type=int, default=512, help="ids a window (default 512)")
    p.add_argument("--skip", type=int, default=4, help="unscored ids at a window's start")
    p.add_argument("--max-ids", type=int, help="score only the text's first N ids")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
