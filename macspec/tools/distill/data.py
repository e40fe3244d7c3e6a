"""Distillation data: continuations sampled from the target, written as shards, and read back.

Per token a shard keeps the id and the target's final hidden state (float16), and the outputs of
the tapped layers when the draft reads them. That is enough for the EAGLE kind: the target's full
next-token distribution is head(hidden), so training recomputes it exactly instead of storing
truncated top-k log-probabilities. Shard j is job j of a seeded plan, so `--resume` keeps the
shards there are and makes the same ones that are missing.
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ...base.errors import MacspecError, ModelError, OptionError
from .progress import bar, end_bar, hms
from .train_prompts import TRAIN_TEXTS

# Temperatures of the rows sampled for one prompt, cycle by cycle: the first cycle gives every
# prompt its greedy row (the aim is greedy acceptance; greedy rows repeat, so one is enough) and a
# row at 0.7, the usual chat setting; later cycles spread over 0.2-1.0, so the draft meets the
# contexts of every setting.
TEMPERATURE_CYCLES = (
    (0.0, 0.7),
    (0.4, 1.0),
    (0.2, 0.8),
    (0.6, 0.9),
)

# Rows sampled together: a bigger batch samples faster, with diminishing returns (README, distill).
DATA_ROWS = 64


def training_prompts(pair: Any, prompts_file: str | None = None) -> list[list[int]]:
    """Token ids of the training prompts (built-in + the user's file), chat template applied."""
    from ..prompts import load_prompts

    texts = list(TRAIN_TEXTS)
    if prompts_file is not None:
        texts += [p.text for p in load_prompts(prompts_file)]
    return chat_ids(pair, texts)


def chat_ids(pair: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text as a user's message, chat template applied."""
    from ...api.stream import prompt_ids

    return [prompt_ids(pair, messages=[{"role": "user", "content": t}]) for t in texts]


def save_atomic(path: Path, arrays: dict[str, mx.array], metadata: dict | None = None) -> None:
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=metadata or {})
    os.replace(tmp, path)


def feature_taps(num_layers: int) -> tuple[int, ...]:
    """Decoder layers whose outputs the data keeps besides the final features: a low, a middle
    and a high one (EAGLE-3's choice: 2, n/2, n-3). The final features say what the target
    predicts; earlier layers still hold what the context was, which predicting the token after
    next needs."""
    last = num_layers - 2  # the last layer's output is the final features before their norm
    if last < 0:
        return ()
    return tuple(sorted({min(2, last), min(num_layers // 2, last), max(num_layers - 3, 0)}))


def _trunk(
    model: Any, inputs: mx.array, cache: list, mask: mx.array, taps: tuple[int, ...] = ()
) -> tuple[mx.array, list[mx.array]]:
    """The decoder trunk with an explicit boolean attention mask (for left-padded batches):
    (final normed features, the outputs of the layers in `taps`).

    RoPE scores depend only on relative positions, so a left-padded row whose pad columns are
    masked out sees exactly what it would see alone. Needs the mlx-lm layout every llama-like
    model uses: model.model.embed_tokens / layers / norm, layer(h, mask, cache)."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    tapped = []
    for i, (layer, c) in enumerate(zip(inner.layers, cache, strict=True)):
        h = layer(h, mask, cache=c)
        if i in taps:
            tapped.append(h)
    return inner.norm(h), tapped


def sample_rows(
    model: Any,
    prompts: list[list[int]],
    temps: list[float],
    max_new: int,
    key: mx.array,
    eos: set[int],
    taps: tuple[int, ...] = (),
    suppress: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Sample one continuation per (prompt, temperature) row, all rows in one left-padded batch;
    ids in `suppress` are never sampled. A row that reaches an EOS id leaves the batch after the
    pass that reads it, so the rows still sampling do not pay for it (chat answers end at very
    different lengths: about half a batch's steps went to ended rows).

    Returns tokens (B, L), hidden (B, L, H) float16 (the target's final hidden state at every
    position), starts (B,) (first real position), ends (B,) (one past the last kept id) and,
    with `taps`, the outputs of those layers (B, L, len(taps), H) float16. Past a row's end its
    tokens and states are zeros."""
    from ...core.target import output_head

    rows, width = len(prompts), max(map(len, prompts))
    starts = np.array([width - len(p) for p in prompts], np.int32)
    full = np.zeros((rows, width + max_new), np.int32)
    for r, p in enumerate(prompts):
        full[r, starts[r] : width] = p
    real = mx.array(np.arange(width)[None] >= starts[:, None])  # (B, width) non-pad columns
    causal = mx.tril(mx.ones((width, width), dtype=mx.bool_))
    cache = batch_cache(model)
    h, t = _trunk(
        model, mx.array(full[:, :width]), cache, (causal[None] & real[:, None, :])[:, None], taps
    )
    hidden = np.zeros((rows, width + max_new, h.shape[-1]), np.float16)
    hidden[:, :width] = np.array(h.astype(mx.float16))
    layers = np.zeros((rows, width + max_new, len(taps), h.shape[-1]), np.float16) if taps else None
    if layers is not None:
        layers[:, :width] = np.array(mx.stack(t, axis=2).astype(mx.float16))
    temp = mx.array(temps, dtype=mx.float32)
    banned = mx.array(list(suppress), dtype=mx.int32) if suppress else None
    ends = np.full(rows, width + max_new, np.int32)
    alive = np.arange(rows)  # the batch's rows: their rows in the output
    stops = np.array(sorted(eos), np.int64)
    for step, step_key in enumerate(mx.random.split(key, max_new)):
        greedy, safe_t = temp == 0, mx.where(temp == 0, 1.0, temp)[:, None]
        logits = output_head(model, h[:, -1]).astype(mx.float32)
        if banned is not None:
            logits[:, banned] = -mx.inf
        sampled = mx.random.categorical(logits / safe_t, key=step_key)
        nxt = mx.where(greedy, mx.argmax(logits, axis=-1), sampled).astype(mx.int32)
        real = mx.concatenate([real, mx.ones((len(alive), 1), mx.bool_)], axis=1)
        h, t = _trunk(model, nxt[:, None], cache, real[:, None, None, :], taps)
        at = width + step
        full[alive, at] = np.array(nxt)
        hidden[alive, at] = np.array(h[:, 0].astype(mx.float16))
        if layers is not None:
            layers[alive, at] = np.array(mx.stack([x[:, 0] for x in t], axis=1).astype(mx.float16))
        ended = np.isin(full[alive, at], stops)
        ends[alive[ended]] = at + 1  # keep the EOS: predicting it matters
        if ended.any():
            keep = np.nonzero(~ended)[0]
            if not keep.size:
                break
            alive, kept = alive[keep], mx.array(keep)
            h, real, temp = h[kept], real[kept], temp[kept]
            for c in cache:  # (B, heads, positions, dim) keys and values, one offset
                c.keys, c.values = c.keys[kept], c.values[kept]
    return full, hidden, starts, ends, layers


def batch_cache(model: Any) -> list[KVCache]:
    """The prompt cache sample_rows runs a left-padded batch through: mlx-lm's plain KVCache in
    every layer, whose rows can leave the batch. A sliding-window or recurrent layer's cache
    takes no per-row padding mask (mlx-lm fails inside the layer), so such a target is a
    ModelError here, naming it, before anything is sampled."""
    cache = make_prompt_cache(model)
    odd = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if odd:
        raise ModelError(
            f"distill samples a batch of rows through a KVCache in every layer; this target has "
            f"{', '.join(odd)} layers (a sliding window or a recurrent state): give it --corpus "
            "text to read instead, one sequence at a time"
        )
    return cache


def parse_feature_layers(value: str, num_layers: int) -> tuple[int, ...]:
    """--feature-layers: "auto", "none" or comma-separated indices of the target's layers."""
    if value == "auto":
        return feature_taps(num_layers)
    if value == "none":
        return ()
    try:
        taps = tuple(sorted({int(v) for v in value.split(",")}))
    except ValueError:
        taps = ()
    if not taps or not all(0 <= t < num_layers - 1 for t in taps):
        raise OptionError(
            f"invalid feature_layers={value!r}: 'auto', 'none' or comma-separated layer "
            f"indices from 0 to {num_layers - 2} (the target has {num_layers} layers)"
        )
    return taps


def data_jobs(prompts: list[list[int]], seed: int, rows: int) -> list[list[tuple[int, float]]]:
    """Batches of (prompt index, temperature) rows, cycling over the prompts with new temperatures.

    Each prompt gets one greedy row overall (greedy continuations repeat themselves) and sampled
    rows over a spread of temperatures, so the draft meets the contexts of every setting."""
    rng = np.random.default_rng(seed)
    jobs: list[list[tuple[int, float]]] = []
    for temps in TEMPERATURE_CYCLES:
        order = rng.permutation(len(prompts)).tolist()
        # Similar lengths together (less padding to compute), but only within windows of 8
        # batches: sorting a whole cycle would put every short prompt first, and a run that
        # stops part-way through a cycle would then have seen only those.
        window = max(1, 8 * rows // len(temps))
        for w in range(0, len(order), window):
            part = sorted(order[w : w + window], key=lambda i: len(prompts[i]))
            cells = [(i, t) for i in part for t in temps]
            jobs += [cells[k : k + rows] for k in range(0, len(cells), rows)]
    return jobs


def generate_data(
    pair: Any,
    prompts: list[list[int]],
    data_dir: Path,
    *,
    tokens: int,
    seed: int,
    rows: int = 64,
    max_new: int = 128,
    taps: tuple[int, ...] = (),
    progress: bool = True,
) -> tuple[int, int]:
    """Write shards until they hold `tokens` generated tokens; existing shards are kept (resume).
    Returns (generated tokens, shards used). With `taps`, shards also keep those layers' outputs.

    Shard j is job j of a seeded plan with its own key, so a resumed run makes the same data."""
    data_dir.mkdir(parents=True, exist_ok=True)
    jobs = data_jobs(prompts, seed, rows)
    eos = set(pair.eos_token_ids)
    have, made, start, j = 0, 0, time.perf_counter(), 0
    while have < tokens:
        shard = data_dir / f"shard-{j:05d}.safetensors"
        if shard.is_file():
            meta = _shard_meta(shard)
        else:
            job = jobs[j % len(jobs)]
            key = mx.random.key(seed * 1_000_003 + j)
            batch = [prompts[i] for i, _ in job]
            toks, hid, starts, ends, layers = sample_rows(
                pair.target, batch, [t for _, t in job], max_new, key, eos, taps
            )
            width = toks.shape[1] - max_new
            meta = {"generated": int((ends - width).sum())}
            arrays = {
                "tokens": mx.array(toks),
                "hidden": mx.array(hid),
                "starts": mx.array(starts),
                "ends": mx.array(ends),
            }
            if layers is not None:
                arrays["layers"] = mx.array(layers)
            save_atomic(shard, arrays, {k: str(v) for k, v in meta.items()})
            made += meta["generated"]
        have += meta["generated"]
        j += 1
        if progress:
            data_bar(made, have, tokens, start)
    if progress:
        end_bar()
    return have, j


def data_bar(made: int, have: int, tokens: int, start: float) -> None:
    """The data stage's progress line: `have` of `tokens`, at the rate of the `made` ones."""
    rate = made / max(time.perf_counter() - start, 1e-9)
    # (a shard may carry the data past `tokens`: nothing is left then, not a negative wait)
    eta = max(0, tokens - have) / rate if rate > 0 else float("nan")
    note = f"{rate:.0f} tok/s  ETA {hms(eta)}" if made else "kept from an earlier run"
    bar("data", min(have, tokens), tokens, note)


def _shard_meta(path: Path) -> dict:
    from ...models.store import _safetensors_header

    meta = _safetensors_header(path).get("__metadata__") or {}
    return {k: int(v) for k, v in meta.items()}


class Dataset:
    """Rows of (ids, features) from the shards, with the first position whose loss counts."""

    def __init__(
        self, data_dir: Path, max_new: int, shards: int | None = None, layers: bool = False
    ):
        """`layers`: rows carry the tapped layer outputs before the final features
        ((len(taps) + 1) * hidden wide), for drafts with feature_layers."""
        self.ids: list[np.ndarray] = []
        self.feats: list[np.ndarray] = []
        self.hidden_size = 0
        self.first: list[int] = []  # draft positions before this predict prompt ids: no loss
        self.prompt: list[int] = []  # which prompt each row continues (a hash of its ids)
        # Only the shards this run counted: a longer earlier run may have left more.
        found = sorted(data_dir.glob("shard-[0-9][0-9][0-9][0-9][0-9].safetensors"))
        for shard in found[:shards]:
            arrays = mx.load(str(shard))
            toks = np.array(arrays["tokens"])
            hid = np.array(arrays["hidden"])  # float16
            self.hidden_size = hid.shape[-1]
            if layers:
                if "layers" not in arrays:
                    raise MacspecError(
                        f"{shard} holds no layer outputs (sampled without feature layers): "
                        "start a new run for a draft with feature layers"
                    )
                tapped = np.array(arrays["layers"])  # (B, L, taps, H)
                hid = np.concatenate([tapped.reshape(*tapped.shape[:2], -1), hid], axis=-1)
            starts, ends = np.array(arrays["starts"]), np.array(arrays["ends"])
            width = toks.shape[1] - max_new
            # Corpus shards (corpus.py) say where each row's loss starts and which file it is.
            first = np.array(arrays["first"]) if "first" in arrays else None
            group = np.array(arrays["group"]).view(np.uint32) if "group" in arrays else None
            for r in range(toks.shape[0]):
                s, e = int(starts[r]), int(ends[r])
                self.ids.append(toks[r, s:e])
                self.feats.append(hid[r, s:e])
                if first is not None and group is not None:
                    self.first.append(int(first[r]))
                    self.prompt.append(int(group[r]))
                    continue
                # Draft position t predicts x_{t+2}; the answer starts at x_width.
                self.first.append(max(0, width - 2 - s))
                # A prompt's number is a hash of its ids, not its order of appearance, so the same
                # prompts are held out whatever the seed: a run continuing a draft (--init) would
                # otherwise measure on prompts the draft was trained on.
                self.prompt.append(zlib.crc32(toks[r, s:width].tobytes()))
        if not self.ids:
            raise MacspecError(f"no training data in {data_dir}")

    def __len__(self) -> int:
        return len(self.ids)

    def split(self, every: int = 20) -> tuple[list[int], list[int]]:
        """(training rows, held-out rows): every `every`-th prompt (or file) is held out with all
        its rows, so agreement is measured on contexts the draft never trained on; one group is
        held out when the bucket catches none, nothing when there is only one."""
        out = {p for p in self.prompt if p % every == every - 1}
        groups = set(self.prompt)
        if not out and len(groups) > 1:
            # No prompt or file fell in the held-out bucket (a few dozen files, say): hold out
            # the one nearest to it, so agreement is still measured on unseen text.
            out = {max(groups, key=lambda p: (p % every, p))}
        held = [r for r, p in enumerate(self.prompt) if p in out]
        return [r for r, p in enumerate(self.prompt) if p not in out], held

    def feature_stats(self, limit: int = 200_000) -> tuple[mx.array, mx.array]:
        """Mean and standard deviation of the target's features, per dimension."""
        rows, n = [], 0
        for f in self.feats:
            if n >= limit:
                break
            rows.append(f)
            n += len(f)
        f = np.concatenate(rows)[:limit].astype(np.float32)
        return mx.array(f.mean(0)), mx.array(f.std(0) + 1e-3)

    def tokens(self) -> int:
        return sum(len(i) - f - 1 for i, f in zip(self.ids, self.first, strict=True))

    def batch(self, rows: list[int]) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(features (B, L, H), next ids (B, L), target features (B, L, H), flat indices of the
        positions whose loss counts) for draft positions t = 0..L-1 of each row, right-padded."""
        length = max(len(self.ids[r]) - 1 for r in rows)
        width, h = self.feats[rows[0]].shape[1], self.hidden_size
        feats = np.zeros((len(rows), length, width), np.float32)
        target = np.zeros((len(rows), length, h), np.float32)
        nxt = np.zeros((len(rows), length), np.int32)
        mask = np.zeros((len(rows), length), np.float32)
        for b, r in enumerate(rows):
            n = len(self.ids[r]) - 1
            feats[b, :n] = self.feats[r][:-1]
            target[b, :n] = self.feats[r][1:, -h:]  # the next position's final features
            nxt[b, :n] = self.ids[r][1:]
            mask[b, self.first[r] : n] = 1.0
        where = mx.array(np.nonzero(mask.reshape(-1))[0].astype(np.int32))
        return mx.array(feats), mx.array(nxt), mx.array(target), where


def choose_vocab(data: Dataset, size: int, always: set[int], vocab_size: int) -> list[int]:
    """The `size` ids most frequent in the data (plus EOS ids), or every id when size <= 0.

    The draft proposes only these, so its head costs size/V of the full one, while the ids it
    misses are rare in practice (coverage is measured and written to the report)."""
    if size <= 0 or size >= vocab_size:
        return list(range(vocab_size))
    counts = np.bincount(np.concatenate(data.ids), minlength=vocab_size)[:vocab_size]
    for t in always:
        if t < vocab_size:
            counts[t] = counts.max() + 1
    return sorted(np.argsort(-counts, kind="stable")[:size].tolist())
