"""Does a draft share its target's tokenizer? The library check and `macspec check TARGET DRAFT`.

Speculation feeds the draft the target's token ids and has the target verify the draft's ids, so an
id must name the same token for both models, and the draft must accept every id the target can emit.
Those two are errors. Differences that only cost acceptance (how text is split, end-of-sequence
ids, tokens one side lacks) are warnings. Output stays exact with them, but the speedup shrinks.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..base import switches
from ..base.errors import CompatError, ModelError
from ..core.caches import describe_kinds
from ..core.drafters.pruned import chosen_size
from . import eagle3_export, mtp
from .store import resolve_model

# Files that define a tokenizer; identical bytes on both sides mean an identical tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

# Texts both tokenizers encode: spacing, digits, code, non-Latin scripts and emoji are where
# tokenizers sharing a vocabulary still split differently.
PROBES = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "  two leading spaces,\ttabs, trailing spaces  \n\nand a blank line",
    "Numbers: 3.14159, 2024-11-22, 1,000,000 and 007.",
    'def area(r: float) -> float:\n    return 3.14 * r ** 2  # "code"\n',
    "Ünïcödé café — “quotes”, 日本語のテキスト, emoji 🙂👍",
    "MiXeD CaSe, URLs https://example.com/a?b=c&d=e and e-mail a.b@example.org",
)
CHAT_PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Mismatch:
    """One id that names different tokens (None: the tokenizer has no token with that id)."""

    id: int
    target: str | None
    draft: str | None


@dataclass
class CompatReport:
    """What `check` found. `errors` make speculation wrong; `warnings` only make it slower."""

    target: str
    draft: str
    target_tokens: int  # ids the target's tokenizer defines (highest id + 1)
    draft_tokens: int
    target_rows: int | None = None  # embedding rows of each model (config.json vocab_size)
    draft_rows: int | None = None
    mismatched_ids: int = 0
    examples: list[Mismatch] = field(default_factory=list)
    probes: int = 0
    probes_differing: int = 0
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Layers per cache kind of each model (caches.kinds), when the models were read.
    caches: dict[str, dict[str, int]] = field(default_factory=dict)
    # The MTP heads kept beside a model (models/mtp.py), e.g. "2 MTP heads (deepseek layout)".
    mtp: dict[str, str] = field(default_factory=dict)

    @property
    def compatible(self) -> bool:
        return not self.errors

    @property
    def usable_vocab(self) -> int:
        """Ids speculation samples from, as `macspec.load` sets `Pair.vocab_size`: the target's
        tokens, cut to both embeddings (to the draft's tokens where its rows are unknown)."""
        rows = [r for r in (self.target_rows, self.draft_rows) if r is not None]
        if self.draft_rows is None:
            rows.append(self.draft_tokens)
        return min(self.target_tokens, *rows)

    def raise_for_errors(self) -> CompatReport:
        """Raise CompatError naming both models and the first problem; return self if compatible."""
        if self.errors:
            more = len(self.errors) - 1
            tail = f" (and {more} more; see `macspec check`)" if more else ""
            raise CompatError(
                f"draft {self.draft} cannot draft for target {self.target}: {self.errors[0]}{tail}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(compatible=self.compatible, usable_vocab=self.usable_vocab)
        return d

    def format(self) -> str:
        def side(name: str, path: str, tokens: int, rows: int | None) -> str:
            emb = "embedding rows unknown" if rows is None else f"{rows} embedding rows"
            return f"{name:<7}{path}\n       {tokens} tokens, {emb}"

        lines = [
            side("target", self.target, self.target_tokens, self.target_rows),
            side("draft", self.draft, self.draft_tokens, self.draft_rows),
            f"ids speculation samples from: {self.usable_vocab}",
            "",
        ]
        shared = min(self.target_tokens, self.draft_tokens)
        if not self.mismatched_ids:
            lines.append(f"ok       ids 0..{shared - 1} name the same token in both tokenizers")
        if self.probes and not self.probes_differing:
            lines.append(f"ok       all {self.probes} probe texts encode to the same ids")
        for side, found in self.caches.items():
            if not any(m.startswith(f"the {side}'s cache") for m in self.errors):
                lines.append(f"ok       {side} caches ({describe_kinds(found)}) rewind exactly")
        for side, heads in self.mtp.items():
            lines.append(f"ok       the {side} carries {heads}: it can draft for itself")
        lines += [f"error    {m}" for m in self.errors]
        lines += [f"warning  {m}" for m in self.warnings]
        lines += [f"note     {m}" for m in self.notes]
        lines.append("")
        if self.errors:
            lines.append("INCOMPATIBLE: this draft cannot be used with this target.")
        elif self.warnings:
            lines.append("compatible: output stays exact, but the warnings above lower acceptance.")
        else:
            lines.append("compatible: same tokenizer, speculation is exact.")
        return "\n".join(lines)


def _id_table(tokenizer: Any) -> list[str | None]:
    """id -> token string over the whole vocabulary, added tokens included; None marks holes."""
    vocab = tokenizer.get_vocab()
    table: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = token
    return table


def _eos_ids(tokenizer: Any) -> set[int]:
    # mlx-lm's TokenizerWrapper has the model's full eos set; a bare HF tokenizer one id (or None).
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def _show(token: str | None) -> str:
    return "(none)" if token is None else repr(token)


def _ids_range(first: int, last: int) -> str:
    return f"id {first}" if first == last else f"ids {first}..{last}"


def _compare_ids(report: CompatReport, target: list, draft: list) -> None:
    bad = [i for i in range(min(len(target), len(draft))) if target[i] != draft[i]]
    report.mismatched_ids = len(bad)
    report.examples = [Mismatch(i, target[i], draft[i]) for i in bad[:MAX_EXAMPLES]]
    if bad:
        shown = ", ".join(
            f"id {m.id}: {_show(m.target)} vs {_show(m.draft)}" for m in report.examples
        )
        report.errors.append(
            f"{len(bad)} of {min(len(target), len(draft))} ids name different tokens "
            f"(target vs draft: {shown}); the draft would predict other text than the target reads"
        )


def _compare_sizes(report: CompatReport, target: list, draft: list) -> None:
    n_t, n_d = len(target), len(draft)
    # Ids the target can emit: its tokens, limited by its own embedding.
    emits = n_t if report.target_rows is None else min(n_t, report.target_rows)
    if report.draft_rows is not None and report.draft_rows < emits:
        first = report.draft_rows
        report.errors.append(
            f"the target emits ids up to {emits - 1} but the draft's embedding has only "
            f"{report.draft_rows} rows: {_ids_range(first, emits - 1)} "
            f"(e.g. {_show(target[first])}) cannot be fed to the draft"
        )
    elif n_t > n_d:
        example = next((t for t in target[n_d:] if t is not None), None)
        report.warnings.append(
            f"the target's tokenizer has {n_t - n_d} tokens the draft's lacks "
            f"({_ids_range(n_d, n_t - 1)}, e.g. {_show(example)}); the draft never learned them "
            "and will rarely propose them"
        )
    if n_d > n_t:
        example = next((t for t in draft[n_t:] if t is not None), None)
        report.warnings.append(
            f"the draft's tokenizer has {n_d - n_t} tokens the target's lacks "
            f"({_ids_range(n_t, n_d - 1)}, e.g. {_show(example)}); drafting them wastes a position"
        )


def _compare_specials(report: CompatReport, target: Any, draft: Any) -> None:
    eos_t, eos_d = _eos_ids(target), _eos_ids(draft)
    if eos_t != eos_d:
        report.warnings.append(
            f"end-of-sequence ids differ (target {sorted(eos_t)}, draft {sorted(eos_d)}); "
            "the target decides where output ends, the draft will mispredict the end"
        )
    if target.bos_token_id != draft.bos_token_id:
        report.warnings.append(
            f"beginning-of-sequence ids differ (target {target.bos_token_id}, "
            f"draft {draft.bos_token_id})"
        )
    if getattr(target, "chat_template", None) != getattr(draft, "chat_template", None):
        report.notes.append(
            "chat templates differ; chats are rendered with the target's template and the draft "
            "reads that text"
        )


def _chat_probe(tokenizer: Any) -> str | None:
    # Some templates reject a system turn; a chat the template cannot render is simply not probed.
    for messages in (CHAT_PROBE, CHAT_PROBE[1:]):
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - templates raise anything (jinja, ValueError, ...)
            continue
    return None


def _compare_encodings(report: CompatReport, target: Any, draft: Any, texts: list[str]) -> None:
    differing = []
    for text in texts:
        ids_t, ids_d = list(target.encode(text)), list(draft.encode(text))
        if ids_t != ids_d:
            differing.append((text, ids_t, ids_d))
    report.probes, report.probes_differing = len(texts), len(differing)
    if differing:
        text, ids_t, ids_d = differing[0]
        # First differing position; where one is a prefix of the other, where the shorter ends.
        k = next((i for i, (a, b) in enumerate(zip(ids_t, ids_d, strict=False)) if a != b), None)
        k = min(len(ids_t), len(ids_d)) if k is None else k
        report.warnings.append(
            f"{len(differing)} of {len(texts)} probe texts encode differently, e.g. {text[:40]!r}: "
            f"from token {k} the target gives {ids_t[k : k + 6]}, the draft {ids_d[k : k + 6]}; "
            "the prompt is encoded by the target, so the draft reads splits it was not trained on"
        )


def check_tokenizers(
    target: Any,
    draft: Any,
    *,
    target_rows: int | None = None,
    draft_rows: int | None = None,
    probes: list[str] | tuple[str, ...] = (),
    target_name: str = "target",
    draft_name: str = "draft",
) -> CompatReport:
    """Compare two loaded tokenizers (mlx-lm TokenizerWrapper or Hugging Face tokenizers).

    `target_rows`/`draft_rows` are the models' embedding rows; without them the check cannot tell
    whether every target id fits the draft. `probes` are texts to encode on top of PROBES.
    """
    table_t, table_d = _id_table(target), _id_table(draft)
    report = CompatReport(
        target_name, draft_name, len(table_t), len(table_d), target_rows, draft_rows
    )
    _compare_ids(report, table_t, table_d)
    _compare_sizes(report, table_t, table_d)
    _compare_specials(report, target, draft)
    texts = [*PROBES, *probes]
    if (chat := _chat_probe(target)) is not None:
        texts.append(chat)
    _compare_encodings(report, target, draft, texts)
    return report


def _config_rows(path: Path) -> int | None:
    # From config.json, so that checking never loads weights.
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(rows) if rows else None


def _load_tokenizer(path: Path) -> Any:
    from mlx_lm.utils import load_config, load_tokenizer

    try:
        eos = load_config(path).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    try:  # as mlx_lm.load does it, so the eos ids are the ones the engine will use
        return load_tokenizer(path, eos_token_ids=eos)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        raise ModelError(f"cannot load the tokenizer in {path}: {e}") from e


def _same_files(a: Path, b: Path) -> bool:
    present = [f for f in TOKENIZER_FILES if (a / f).exists() or (b / f).exists()]
    return bool(present) and all(
        (a / f).exists() and (b / f).exists() and (a / f).read_bytes() == (b / f).read_bytes()
        for f in present
    )


def check(target: str | Path, draft: str | Path, *, probe: list[str] | None = None) -> CompatReport:
    """Check that the draft model can draft for the target (model directories or store names)."""
    target_dir, draft_dir = resolve_model(target), resolve_model(draft)
    if eagle3_export.is_draft(draft_dir):
        return _check_eagle3(target_dir, draft_dir)
    report = check_tokenizers(
        _load_tokenizer(target_dir),
        _load_tokenizer(draft_dir),
        target_rows=_config_rows(target_dir),
        draft_rows=_config_rows(draft_dir),
        probes=probe or (),
        target_name=str(target_dir),
        draft_name=str(draft_dir),
    )
    if _same_files(target_dir, draft_dir):
        report.notes.insert(0, "the tokenizer files are byte-identical")
    for side, rows in (("target", report.target_rows), ("draft", report.draft_rows)):
        if rows is None:
            report.warnings.append(f"no vocab_size in the {side}'s config.json: rows not checked")
    for side, path in (("target", target_dir), ("draft", draft_dir)):
        _check_caches(report, side, path)
        if heads := mtp.summary(path):
            report.mtp[side] = heads
    if size := chosen_size(report.usable_vocab, switches.DRAFT_VOCAB.value()):
        report.notes.append(
            f"the draft's head scores its {size:,} lowest ids, the special ids and the prompt's of "
            f"{report.usable_vocab:,}; the target alone gives the others "
            f"({switches.DRAFT_VOCAB}=0: every id)"
        )
    return report


def _check_eagle3(target_dir: Path, draft_dir: Path) -> CompatReport:
    """An EAGLE-3 draft has no tokenizer: it names the target's ids (d2t). Checked as
    macspec.load checks it: its layout, then architecture, width, vocabulary and layers."""
    from . import eagle3

    tokens = len(_load_tokenizer(target_dir)._tokenizer)
    rows = _config_rows(target_dir)
    report = CompatReport(str(target_dir), str(draft_dir), tokens, tokens, rows, rows)
    try:
        ckpt = eagle3.load(draft_dir)
        config = json.loads((target_dir / "config.json").read_text())
        eagle3.check_target(ckpt, config, str(target_dir))
    except (ModelError, OSError, ValueError) as e:
        report.errors.append(str(e))
        return report
    c = ckpt.config
    report.notes.append(
        f"an EAGLE-3 draft ({c.format} format) proposing {c.draft_vocab_size} of the target's "
        f"ids: it reads the target's tokenizer, embeddings and features, so no tokenizer is "
        "compared; its architecture, width, vocabulary and layers fit the target"
    )
    if heads := mtp.summary(target_dir):
        report.mtp["target"] = heads
    return report


def _check_caches(report: CompatReport, side: str, path: Path) -> None:
    """Which cache kinds the model's layers have, and whether speculation rewinds them exactly
    (recurrent layers: checked by running the model a few tokens). Feature drafts have none."""
    if (path / "draft.json").is_file():
        return
    from mlx_lm.utils import load_model

    from ..core import caches

    try:
        model, _ = load_model(path, lazy=True)
    except Exception as e:  # mlx-lm raises anything from deep inside; the tokenizer check stands
        report.warnings.append(f"could not read the {side} model to check its caches: {e}")
        return
    report.caches[side] = caches.kinds(model)
    try:
        caches.check(model, report.usable_vocab)
    except ModelError as e:
        report.errors.append(f"the {side}'s caches ({describe_kinds(report.caches[side])}): {e}")


def _run(args: argparse.Namespace) -> int:
    report = check(args.target, args.draft, probe=args.probe)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    if not report.compatible:  # the report above names every problem; the exit status says no
        n = len(report.errors)
        raise CompatError(
            f"{report.draft} cannot draft for {report.target} ({n} problem{'s' * (n > 1)} above)"
        )
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check",
        help="check that a draft model shares the target's tokenizer",
        description="Check that DRAFT can draft for TARGET: the same token ids, every target id "
        "accepted by the draft. Exit status 0 if compatible, 1 if not.",
    )
    p.add_argument("target", help="target model directory or store name")
    p.add_argument("draft", help="draft model directory or store name")
    p.add_argument(
        "--probe",
        action="append",
        metavar="TEXT",
        help="also compare how both tokenizers encode TEXT (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
