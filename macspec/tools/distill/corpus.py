"""Teacher-forced distillation data from the user's text files (`--corpus DIR|FILE`).

Sampling continuations costs one target pass per token and row; reading existing text costs a
prefill, many ids a pass: for the 1.5B target on a 2-core CPU ~90 ids/s against ~15 sampled. The
draft learns the target's distribution at every position of the text (its final hidden state
gives the full distribution), so what matters is that the contexts look like drafting's: each
piece of a file is the assistant's answer to a user asking for that file, in the chat template.

Shards keep the layout generate_data writes (data.py), plus `first` (the first draft position
whose loss counts) and `group` (a hash of the file's name, so held-out rows are whole files).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ...base.errors import ModelError
from .data import data_bar, save_atomic
from .progress import end_bar

# What a directory's text files are, by suffix (a FILE given by name is read whatever its suffix).
SUFFIXES = frozenset(
    ".py .pyi .md .rst .txt .c .h .cc .cpp .hpp .rs .go .java .js .ts .tsx .jsx .sh .toml .yaml "
    ".yml .json .html .css .sql .rb .lua .swift .kt .scala .tex .cfg .ini".split()
)
ROWS_PER_SHARD = 8
MIN_PIECE = 32  # a file's tail shorter than this is dropped: too little to learn from


@dataclass(frozen=True)
class Row:
    prompt: list[int]  # the chat template up to the assistant's answer
    text: list[int]  # a piece of the file: the answer, where the loss counts
    group: int  # crc32 of the file's path under the corpus


def corpus_files(path: str) -> tuple[Path, list[Path]]:
    """(root, files): the text files under a directory (by suffix, sorted), or the one file.
    ModelError for a path that does not exist or holds no text file."""
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise ModelError(f"corpus {path} does not exist")
    if root.is_file():
        return root.parent, [root]
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
    if not files:
        raise ModelError(
            f"corpus {root} holds no text files (looked for {', '.join(sorted(SUFFIXES))})"
        )
    return root, files


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""  # binary or unreadable: not text
    return "" if "\x00" in text else text


def corpus_rows(pair: Any, path: str, tokens: int, length: int, seed: int) -> list[Row]:
    """Rows holding at least `tokens` ids of text, `length` ids a piece, files in a seeded order.

    The plan depends only on the corpus, the seed and `length`: a resumed run (with the same or
    a larger `tokens`) makes the same rows first. ModelError when the corpus holds no text."""
    from ...api.stream import prompt_ids

    root, files = corpus_files(path)
    order = np.random.default_rng(seed).permutation(len(files))
    rows: list[Row] = []
    have = 0
    for i in order.tolist():
        if have >= tokens:
            break
        text = _read(files[i])
        if not text.strip():
            continue
        ids = pair.tokenizer.encode(text, add_special_tokens=False)
        name = files[i].relative_to(root).as_posix()
        group = zlib.crc32(name.encode())
        pieces = [ids[k : k + length] for k in range(0, len(ids), length)]
        pieces = [p for p in pieces if len(p) >= MIN_PIECE]
        for n, piece in enumerate(pieces, 1):
            part = f" (part {n} of {len(pieces)})" if len(pieces) > 1 else ""
            ask = [{"role": "user", "content": f"Show me {name}{part}."}]
            rows.append(Row(prompt_ids(pair, messages=ask), piece, group))
            have += len(piece)
    if not rows:
        raise ModelError(f"corpus {path} holds no text (every file was empty or binary)")
    return rows


def corpus_data(
    pair: Any,
    rows: list[Row],
    data_dir: Path,
    *,
    tokens: int,
    taps: tuple[int, ...],
    progress: bool = True,
) -> tuple[int, int]:
    """Write shards of the target's features over `rows` until they hold `tokens` text ids;
    existing shards are kept (resume). Returns (text ids, shards used)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ...core.target import hidden_states

    data_dir.mkdir(parents=True, exist_ok=True)
    model = pair.target
    have, made, start, j = 0, 0, time.perf_counter(), 0
    while have < tokens and j * ROWS_PER_SHARD < len(rows):
        shard = data_dir / f"shard-{j:05d}.safetensors"
        part = rows[j * ROWS_PER_SHARD : (j + 1) * ROWS_PER_SHARD]
        count = sum(len(r.text) for r in part)
        if not shard.is_file():
            feats = [
                hidden_states(model, mx.array(r.prompt + r.text), make_prompt_cache(model), taps)
                for r in part
            ]
            width = feats[0].shape[-1] // (len(taps) + 1)
            save_atomic(shard, _arrays(part, feats, width, len(taps)), {"generated": str(count)})
            made += count
        have += count
        j += 1
        if progress:
            data_bar(made, have, tokens, start)
    if progress:
        end_bar()
    return have, j


def _arrays(part: list[Row], feats: list[mx.array], h: int, taps: int) -> dict[str, mx.array]:
    """One shard in data.py's layout, right-padded: tokens (B, L), hidden (B, L, H), layers
    (B, L, taps, H) when tapped, starts, ends, and first / group (see the module's docstring)."""
    length = max(len(r.prompt) + len(r.text) for r in part)
    tokens = np.zeros((len(part), length), np.int32)
    hidden = mx.zeros((len(part), length, h), mx.float16)
    layers = mx.zeros((len(part), length, taps, h), mx.float16) if taps else None
    for b, (r, f) in enumerate(zip(part, feats, strict=True)):
        n = len(r.prompt) + len(r.text)
        tokens[b, :n] = r.prompt + r.text
        f = f.astype(mx.float16)
        hidden[b, :n] = f[:, taps * h :]
        if layers is not None:
            layers[b, :n] = f[:, : taps * h].reshape(n, taps, h)
    arrays = {
        "tokens": mx.array(tokens),
        "hidden": hidden,
        "starts": mx.zeros((len(part),), mx.int32),
        "ends": mx.array([len(r.prompt) + len(r.text) for r in part], dtype=mx.int32),
        # Draft position t predicts id t + 2; the text starts at id len(prompt).
        "first": mx.array([max(0, len(r.prompt) - 2) for r in part], dtype=mx.int32),
        "group": mx.array(np.array([r.group for r in part], np.uint32).view(np.int32)),
    }
    if layers is not None:
        arrays["layers"] = layers
    return arrays
