"""`macspec eval`: a model's perplexity on a text, and with a reference model how far its next-token
distributions are from the reference's on the same ids (mean / median / p99 KL, top-1 agreement),
as llama.cpp's `llama-perplexity --kl-divergence` reports (the scoring: models/fidelity.py).

Both models read the same ids: the model's tokenizer encodes the text, and a reference whose
tokenizer differs is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx

from ..base import logs
from ..base.errors import ModelError, OptionError
from ..models.fidelity import Report, score

log = logging.getLogger("macspec.tools")


def _load(name: str):
    """(model, tokenizer) of a store name, a model directory or a GGUF file (decoded to float32
    in a temporary directory: its exact weights)."""
    from ..api import pair as pairs
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
