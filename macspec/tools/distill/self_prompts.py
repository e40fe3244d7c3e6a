"""Training prompts written by the target itself (Magpie, Xu et al. 2024): the chat template up
to an open user turn makes an instruct model write what a user would ask. A draft trained on a
few hundred fixed prompts stops improving with more of their continuations (MODEL_CARD.md of the
default draft); these prompts add the variety, with no dataset to download.

They are kept in the work directory, so a resumed run samples the same data from the same ones.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ...base.errors import PromptError
from ..prompts import BUILTIN
from .data import sample_rows
from .progress import bar, end_bar, hms
from .train_prompts import TRAIN_TEXTS

_MARK = "\x00macspec-user-turn\x00"

# The benchmark's topics, kept out of training like the built-in training prompts keep them out
# (train_prompts.py): a self-written prompt that mentions one is dropped.
HELD_OUT_WORDS = (
    "sleep", "sky", "virus", "bacteri", "language", "lighthouse", "snow", "always night",
    "mystery", "prime", "csv", "debounce", "sql", "customers", "recipe", "email", "summar",
)  # fmt: skip


def open_user_turn(pair: Any) -> list[int]:
    """The ids of the target's chat template up to where a user's message would begin."""
    from ...api import chat_template
    from ...api.stream import prompt_ids

    text = chat_template.render(pair.tokenizer, [{"role": "user", "content": _MARK}])
    if _MARK not in text:
        raise PromptError(
            f"the chat template of {pair.target_path} does not show the user's message, so the "
            "target cannot write prompts itself; give --prompts instead"
        )
    return prompt_ids(pair, text[: text.index(_MARK)])


def keep(text: str, seen: set[str]) -> bool:
    """A usable new prompt: a few words at least, not one already kept or built in, and not on a
    benchmark topic."""
    words, norm = text.split(), _norm(text)
    if not 3 <= len(words) <= 80 or norm in seen:
        return False
    return not any(w in norm for w in HELD_OUT_WORDS)


def _norm(text: str) -> str:
    """A prompt as repeats are recognised: spaces and case do not count."""
    return " ".join(text.split()).casefold()


def self_prompts(
    pair: Any,
    count: int,
    work: Path,
    *,
    seed: int,
    rows: int = 64,
    max_new: int = 64,
    temperature: float = 1.0,
    progress: bool = True,
) -> list[str]:
    """`count` distinct user prompts written by the target, sampled `rows` at a time; prompts
    kept in `work` by an earlier run are reused (resume) and the rest appended."""
    path = work / "self-prompts.json"
    work.mkdir(parents=True, exist_ok=True)
    texts: list[str] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    if len(texts) >= count:
        return texts[:count]
    builtin = [*TRAIN_TEXTS, *(t for kind in BUILTIN.values() for t in kind)]
    seen = {_norm(t) for t in builtin + texts}
    prefix = open_user_turn(pair)
    ends = set(pair.eos_token_ids)
    # A template's markers inside a message would make no prompt: only the end is allowed.
    specials = set(getattr(pair.tokenizer, "all_special_ids", None) or ()) - ends
    start, had, batch, tried = time.perf_counter(), len(texts), 0, 0
    while len(texts) < count:
        # Batch j has its own key, so a resumed run goes on with new samples, not the same ones.
        key = mx.random.key(seed * 1_000_003 + 7_919 * (len(texts) + batch + 1))
        temps = [temperature] * rows
        tokens = sample_rows(
            pair.target, [prefix] * rows, temps, max_new, key, ends, suppress=tuple(specials)
        )[0]
        batch += rows
        for row in tokens[:, len(prefix) :]:
            stop = np.nonzero(np.isin(row, list(ends)))[0]
            if not stop.size:  # ran past max_new: an unfinished message
                continue
            ids = row[: stop[0]].tolist()
            tried += 1
            text = pair.tokenizer.decode(ids).strip()
            if keep(text, seen) and len(texts) < count:
                seen.add(_norm(text))
                texts.append(text)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(texts, indent=0, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)  # an interrupted run leaves the last whole list
        if progress:
            rate = (len(texts) - had) / max(time.perf_counter() - start, 1e-9)
            left = (count - len(texts)) / rate if rate > 0 else float("nan")
            bar("asks", len(texts), count, f"{len(texts) - had} of {tried} kept, ETA {hms(left)}")
        if batch > 50 * count:
            raise PromptError(
                f"the target wrote only {len(texts)} usable prompts of {count} in {batch} tries; "
                "ask for fewer or give --prompts instead"
            )
    if progress:
        end_bar()
    return texts
