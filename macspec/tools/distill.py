"""`macspec distill`: train a draft for any target from the target itself, then measure it.

Pipeline (every stage writes incrementally into a work directory, so `--resume` continues):
1. data: continuations sampled from the target over a varied prompt set, batched, at a mix of
   temperatures; per token we keep the id and the target's final hidden state (float16). That is
   enough for the EAGLE kind: the target's full next-token distribution is head(hidden), so it is
   recomputed exactly during training instead of storing truncated top-k log-probabilities.
2. train: the draft (macspec/eagle.py) by distillation, AdamW with warm-up + cosine decay,
   checkpoints, a progress bar with loss, tokens/s and ETA; seeded.
3. evaluate: acceptance rate and mean accepted length at K=4 (temperature 0 and 0.7) on held-out
   prompts (the built-in benchmark prompts, never trained on), and the draft step cost relative to a
   target step; written to report.json next to the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import MacspecError, ModelError, OptionError, PromptError
from .distill_prompts import TRAIN_PROMPTS

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


def _say(msg: str) -> None:
    print(f"macspec: {msg}", file=sys.stderr, flush=True)


def training_prompts(pair: Any, prompts_file: str | None = None) -> list[list[int]]:
    """Token ids of the training prompts (built-in + the user's file), chat template applied."""
    from .prompts import load_prompts, render

    texts = [t for kind in TRAIN_PROMPTS.values() for t in kind]
    if prompts_file is not None:
        texts += [p.text for p in load_prompts(prompts_file)]
    return [encode(pair.tokenizer, render(pair.tokenizer, t)) for t in texts]


def encode(tokenizer: Any, text: str) -> list[int]:
    # As macspec.generate: BOS only when the (templated) text does not already start with it.
    add_special = tokenizer.bos_token is None or not text.startswith(tokenizer.bos_token)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


# ---------------------------------------------------------------- data


def _save_atomic(path: Path, arrays: dict[str, mx.array], metadata: dict | None = None) -> None:
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Sample one continuation per (prompt, temperature) row, all rows in one left-padded batch.

    Returns tokens (B, L), hidden (B, L, H) float16 (the target's final hidden state at every
    position), starts (B,) (first real position), ends (B,) (one past the last kept id) and,
    with `taps`, the outputs of those layers (B, L, len(taps), H) float16."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..engine.round import output_head

    rows, width = len(prompts), max(map(len, prompts))
    starts = np.array([width - len(p) for p in prompts], np.int32)
    padded = np.zeros((rows, width), np.int32)
    for r, p in enumerate(prompts):
        padded[r, starts[r] :] = p
    real = mx.array(np.arange(width)[None] >= starts[:, None])  # (B, width) non-pad columns
    causal = mx.tril(mx.ones((width, width), dtype=mx.bool_))
    cache = make_prompt_cache(model)
    h, t = _trunk(model, mx.array(padded), cache, (causal[None] & real[:, None, :])[:, None], taps)
    hidden, tapped, tokens = [h.astype(mx.float16)], [t], []
    t = mx.array(temps, dtype=mx.float32)
    greedy, safe_t = t == 0, mx.where(t == 0, 1.0, t)[:, None]
    for step_key in mx.random.split(key, max_new):
        logits = output_head(model, h[:, -1]).astype(mx.float32)
        sampled = mx.random.categorical(logits / safe_t, key=step_key)
        nxt = mx.where(greedy, mx.argmax(logits, axis=-1), sampled).astype(mx.int32)
        real = mx.concatenate([real, mx.ones((rows, 1), mx.bool_)], axis=1)
        h, layers = _trunk(model, nxt[:, None], cache, real[:, None, None, :], taps)
        tokens.append(nxt)
        hidden.append(h.astype(mx.float16))
        tapped.append([x.astype(mx.float16) for x in layers])
        mx.eval(nxt, hidden[-1], tapped[-1])
    gen = np.array(mx.stack(tokens, axis=1))
    ends = np.full(rows, width + max_new, np.int32)
    for r in range(rows):
        stop = np.nonzero(np.isin(gen[r], list(eos)))[0]
        if stop.size:
            ends[r] = width + stop[0] + 1  # keep the EOS: predicting it matters
    full = np.concatenate([padded, gen], axis=1)
    layers = None
    if taps:  # (B, L, taps, H): per step a list over taps of (B, n, H)
        per_step = [mx.stack(step, axis=2) for step in tapped]
        layers = np.array(mx.concatenate(per_step, axis=1))
    return full, np.array(mx.concatenate(hidden, axis=1)), starts, ends, layers


# Rows sampled together: 64 rows ran at 145 tokens/s on 2 cores, 32 at 126, 128 at 158.
DATA_ROWS = 64


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
            _save_atomic(shard, arrays, {k: str(v) for k, v in meta.items()})
            made += meta["generated"]
        have += meta["generated"]
        j += 1
        if progress:
            rate = made / max(time.perf_counter() - start, 1e-9)
            eta = (tokens - have) / rate if rate > 0 else float("nan")
            note = f"{rate:.0f} tok/s  ETA {_hms(eta)}" if made else "kept from an earlier run"
            _bar("data", min(have, tokens), tokens, note)
    if progress:
        print(file=sys.stderr)
    return have, j


def _shard_meta(path: Path) -> dict:
    from ..models.store import _safetensors_header

    meta = _safetensors_header(path).get("__metadata__") or {}
    return {k: int(v) for k, v in meta.items()}


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _bar(label: str, done: float, total: float, extra: str) -> None:
    width = 24
    filled = int(width * done / total) if total else width
    pct = 100 * done / total if total else 100
    line = f"\r{label:5s} [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}%  {extra}"
    print(line, end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- training data in memory


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
            for r in range(toks.shape[0]):
                s, e = int(starts[r]), int(ends[r])
                self.ids.append(toks[r, s:e])
                self.feats.append(hid[r, s:e])
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
        """(training rows, held-out rows): every `every`-th prompt is held out with all its rows,
        so agreement is measured on contexts the draft never trained on."""
        held = [r for r, p in enumerate(self.prompt) if p % every == every - 1]
        if not held:  # too few prompts: hold out nothing rather than everything
            return list(range(len(self))), []
        return [r for r, p in enumerate(self.prompt) if p % every != every - 1], held

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

    The draft proposes only these, so its head costs size/V of the full one: at 8,192 of 49,152
    ids the draft step is ~5x cheaper while the ids it misses are rare in practice (coverage is
    measured and written to the report)."""
    if size <= 0 or size >= vocab_size:
        return list(range(vocab_size))
    counts = np.bincount(np.concatenate(data.ids), minlength=vocab_size)[:vocab_size]
    for t in always:
        if t < vocab_size:
            counts[t] = counts.max() + 1
    return sorted(np.argsort(-counts, kind="stable")[:size].tolist())


# ---------------------------------------------------------------- training


def _loss(
    draft: Any, head: mx.array, embed: Callable, batch: tuple, reg_weight: float, unroll: int
) -> tuple[mx.array, mx.array]:
    """Distillation loss and top-1 agreement (of the first pass) over the masked positions.

    Pass 1 feeds the target's features (teacher forcing). Each further pass feeds the previous
    pass's predicted features instead, as drafting does from its second token on, so the draft
    learns to build on its own predictions ("training-time test", EAGLE-3/HASS)."""
    feats, nxt, target, where = batch
    embeds = embed(nxt)
    h = target.shape[-1]
    # The head (most of the cost) runs only at the positions whose loss counts.
    tgt = target.reshape(-1, h)[where]
    p = mx.softmax(tgt @ head.T, axis=-1)  # the target's distribution over the draft's ids
    best = mx.argmax(p, axis=-1)
    total, agree = mx.array(0.0), mx.array(0.0)
    for step, out in enumerate(unrolled(draft, draft.state(feats), embeds, unroll)):
        gk = draft.decode(out.reshape(-1, h)[where])
        logq = nn_log_softmax(gk @ head.T)
        ce = -(p * logq).sum(-1)
        diff = mx.abs(gk - tgt) / draft.feature_std[-h:]  # in standardised units
        reg = mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)  # smooth L1
        total = total + (ce + reg_weight * reg).mean()
        if step == 0:
            agree = (mx.argmax(logq, axis=-1) == best).mean()
    return total / unroll, agree


def unrolled(draft: Any, state: mx.array, embeds: mx.array, steps: int) -> list[mx.array]:
    """The draft's outputs (standardised predictions) for `steps` drafting steps from every
    position at once, each attending exactly as it does when drafting (EAGLE-3's
    "training-time test").

    Step s at position t stands for the s-th draft token after anchor j = t - s, the last
    position the target ran: its state is step s-1's output at t-1, and it attends to step 0's
    keys up to j (the draft cache holds real positions there) and to step r's key at j + r for
    r = 1..s (the positions this proposal fed). Attending to all of step s's own keys instead
    would train later positions on contexts of nothing but guesses, which drafting never sees."""
    block, attn = draft.layer, draft.layer.self_attn
    b, n, _ = embeds.shape
    e = draft.embed_norm(embeds)
    pos = mx.arange(n)
    repeat = attn.n_heads // attn.n_kv_heads
    keys: list[mx.array] = []
    values: list[mx.array] = []
    outs = []

    def heads(x: mx.array, count: int) -> mx.array:
        return x.reshape(b, n, count, -1).transpose(0, 2, 1, 3)

    def shifted(x: mx.array, by: int) -> mx.array:  # x[t - by] at t (zeros before the start)
        if by == 0:
            return x
        return mx.concatenate([mx.zeros_like(x[:, :, :by]), x[:, :, : n - by]], axis=2)

    for s in range(steps):
        x = draft.fc(mx.concatenate([e, state], axis=-1))
        h = block.input_layernorm(x)
        q = attn.rope(heads(attn.q_proj(h), attn.n_heads)) * attn.scale
        keys.append(mx.repeat(attn.rope(heads(attn.k_proj(h), attn.n_kv_heads)), repeat, axis=1))
        values.append(mx.repeat(heads(attn.v_proj(h), attn.n_kv_heads), repeat, axis=1))
        # Real keys up to the anchor (at least key 0, so rows without an anchor stay finite;
        # their positions carry no loss).
        real = pos[None, :] <= mx.maximum(pos[:, None] - s, 0)
        scores = [mx.where(real, q @ keys[0].transpose(0, 1, 3, 2), -mx.inf)]
        diag = []
        for r in range(1, s + 1):
            k_r, v_r = shifted(keys[r], s - r), shifted(values[r], s - r)
            score = (q * k_r).sum(-1, keepdims=True)
            scores.append(mx.where((pos >= s - r)[:, None], score, -mx.inf))
            diag.append(v_r)
        w = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
        o = w[..., :n] @ values[0]
        for r, v_r in enumerate(diag):
            o = o + w[..., n + r : n + r + 1] * v_r
        x = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))
        out = x + block.mlp(block.post_attention_layernorm(x))
        outs.append(out)
        # Position t's next state: this step's prediction made at t - 1.
        state = mx.concatenate([state[:, :1], out[:, :-1]], axis=1)
    return outs


def nn_log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def lr_schedule(lr: float, steps: int, warmup: int) -> Callable:
    import mlx.optimizers as optim

    warm = optim.linear_schedule(lr * 0.01, lr, max(warmup, 1))
    cosine = optim.cosine_decay(lr, max(steps - warmup, 1), lr * 0.05)
    return optim.join_schedules([warm, cosine], [max(warmup, 1)])


def train(
    draft: Any,
    parts: Any,
    data: Dataset,
    ckpt_dir: Path,
    *,
    epochs: int,
    batch_rows: int,
    lr: float,
    seed: int,
    reg_weight: float = 1.0,
    unroll: int = 2,
    resume: bool = False,
    checkpoint_every: int = 50,
    progress: bool = True,
    rows: list[int] | None = None,
) -> dict:
    """AdamW with warm-up and cosine decay; returns training facts for the report.

    The batch order of epoch e is a permutation seeded by (seed, e), and checkpoints hold the
    weights, the optimizer state and the step, so a resumed run takes the very same steps."""
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten

    train_rows = list(range(len(data))) if rows is None else rows
    per_epoch = max(1, math.ceil(len(train_rows) / batch_rows))
    steps = epochs * per_epoch
    warmup = min(max(10, steps // 10), steps // 2)
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=0.01)
    head = parts.head
    loss_and_grad = nn_value_and_grad(
        draft, lambda b: _loss(draft, head, parts.embed, b, reg_weight, unroll)
    )
    step = 0
    ckpt = ckpt_dir / "checkpoint.safetensors"
    if resume and ckpt.is_file():
        saved = mx.load(str(ckpt))
        draft.load_weights([(k[6:], v) for k, v in saved.items() if k.startswith("model.")])
        opt.init(draft.trainable_parameters())
        state = tree_unflatten([(k[4:], v) for k, v in saved.items() if k.startswith("opt.")])
        opt.state = state
        step = int(json.loads((ckpt_dir / "checkpoint.json").read_text())["step"])
        _say(f"resuming training at step {step}/{steps}")
    mx.eval(draft.parameters())

    def save(step: int) -> None:
        arrays = {f"model.{k}": v for k, v in tree_flatten(draft.parameters())}
        arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
        _save_atomic(ckpt, arrays)
        (ckpt_dir / "checkpoint.json").write_text(json.dumps({"step": step, "steps": steps}))

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start, done_tokens, ema_loss, ema_acc = time.perf_counter(), 0, None, None
    first = step
    while step < steps:
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(train_rows)
        rows = order[i * batch_rows : (i + 1) * batch_rows].tolist()
        batch = data.batch(rows)
        (loss, acc), grads = loss_and_grad(batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state, loss, acc)
        step += 1
        done_tokens += batch[3].size
        ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
        ema_acc = acc.item() if ema_acc is None else 0.9 * ema_acc + 0.1 * acc.item()
        if step % checkpoint_every == 0 or step == steps:
            save(step)
        if progress:
            elapsed = time.perf_counter() - start
            rate = done_tokens / max(elapsed, 1e-9)
            eta = elapsed / (step - first) * (steps - step)
            _bar(
                "train",
                step,
                steps,
                f"step {step}/{steps}  loss {ema_loss:.3f}  top1 {ema_acc:.2f}  "
                f"{rate:.0f} tok/s  ETA {_hms(eta)}",
            )
    if progress:
        print(file=sys.stderr)
    return {
        "steps": steps,
        "epochs": epochs,
        "batch_rows": batch_rows,
        "lr": lr,
        "unroll": unroll,
        "reg_weight": reg_weight,
        "final_loss": ema_loss,
    }


def nn_value_and_grad(model: Any, fn: Callable) -> Callable:
    import mlx.nn as nn

    return nn.value_and_grad(model, fn)


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
            g = draft.decode(pred.reshape(-1, h)[where])
            hit = (mx.argmax(g @ parts.head.T, axis=-1) == best).sum()
            if len(out) <= step:
                out.append([0.0, 0.0])
            out[step][0] += hit.item()
            out[step][1] += where.size
    return [round(a / max(n, 1), 4) for a, n in out]


# ---------------------------------------------------------------- evaluation


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
    from ..api import generate
    from .prompts import builtin_prompts, render

    prompts = []
    for p in builtin_prompts():
        ids = encode(pair.tokenizer, render(pair.tokenizer, p.text))
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
            _bar("eval", done, total, "")

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
        print(file=sys.stderr)
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
    from ..api import generate

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
    out = {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(emitted / rounds, 3) if rounds else 1.0,
        "drafted": drafted,
    }
    if drafted and plain:
        # Seconds per drafted token over seconds per plain target step.
        out["draft_step_cost"] = round(draft_time / drafted / (sum(plain) / len(plain)), 4)
    return out


# ---------------------------------------------------------------- the command


def _output_dir(output: str) -> Path:
    from ..models.store import _looks_like_path, store_root, validate_name

    if not isinstance(output, str) or not output:
        raise OptionError("give the draft a name or a directory: -o NAME")
    if _looks_like_path(output):
        return Path(output).expanduser().resolve()
    return store_root() / validate_name(output)


def _writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OptionError(f"cannot write to {path}: {e.strerror or e}") from None


def _copy_tokenizer(src: Path, dest: Path) -> None:
    # The draft speaks the target's ids: `macspec check` and `macspec models` read these files.
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
    ):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)


def distill(
    target: str,
    output: str,
    kind: str = "eagle",
    tokens: int = 60_000,
    prompts: str | None = None,
    seed: int = 0,
    resume: bool = False,
    epochs: int = 6,
    batch_rows: int = 16,
    lr: float = 1e-3,
    vocab: int = 8192,
    max_new: int = 128,
    unroll: int = 2,
    feature_layers: str | None = None,
    eval_tokens: int = 96,
    init: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Train a draft for `target` and write it to `output` (a store name or a directory).

    Work files (sampled data, checkpoints) go to a hidden `.distill-<name>` directory beside the
    output, so an interrupted run continues with resume=True. `init` (a draft directory or store
    name) continues training an existing eagle draft for this target on this run's data: its
    weights, vocabulary and feature statistics are the starting point (`vocab` is not used).
    `feature_layers`: "auto" (a low, a middle and a high layer, as EAGLE-3), "none" (the final
    features only) or comma-separated layer indices; by default "auto", or with `init` the
    layers that draft reads. An `init` draft reading the final features only can be given
    layers: it is widened, starting out exactly as it was (see widen_draft).
    Returns the draft's directory."""
    from ..engine.eagle import EagleDraft, TargetParts, draft_config, load_draft, save_draft
    from ..pair import load

    if kind != "eagle":
        raise OptionError(
            f"unknown kind {kind!r}: only 'eagle' is implemented (a from-scratch 'small' draft "
            "reached 0.35 agreement on this budget, see macspec/eagle.py)"
        )
    for name, value in (
        ("tokens", tokens),
        ("epochs", epochs),
        ("batch_rows", batch_rows),
        ("max_new", max_new),
        ("unroll", unroll),
        ("eval_tokens", eval_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(f"invalid {name}={value!r}: must be an integer >= 1")
    out = _output_dir(output)
    work = out.parent / f".distill-{out.name}"
    if out.exists() and not force:
        raise OptionError(f"{out} already exists; pass --force to replace it")
    if work.exists() and not resume:
        raise OptionError(
            f"an earlier distill run left {work}: pass --resume to continue it, or delete it"
        )
    pair = load(target)  # raises ModelError for a missing target
    start_from = None if init is None else _init_draft(init, pair)  # before the long part
    num_layers = len(pair.target.model.layers)
    if feature_layers is None:
        feature_layers = "auto" if start_from is None else "init"
    taps = (
        tuple(start_from[0].feature_layers)
        if feature_layers == "init"
        else parse_feature_layers(feature_layers, num_layers)
    )
    if start_from is not None and start_from[0].feature_layers not in ((), taps):
        raise OptionError(
            f"the draft {start_from[2]} reads target layers {list(start_from[0].feature_layers)}:"
            f" continue it with those, not feature_layers={feature_layers!r}"
        )
    ids = training_prompts(pair, prompts)  # raises PromptError for a bad prompt file
    fits = [p for p in ids if len(p) + max_new < pair.context_length]
    if not fits:
        raise PromptError(f"no training prompt fits the target's context of {pair.context_length}")
    _writable(work)
    settings = {
        "target": str(pair.target_path),
        "seed": seed,
        "max_new": max_new,
        "rows": DATA_ROWS,
        "prompts": len(fits),
        "feature_layers": list(taps),
        "vocab": vocab,
        "unroll": unroll,
        "epochs": epochs,
        "batch_rows": batch_rows,
        "lr": lr,
        "tokens": tokens,
        "init": None if start_from is None else str(start_from[2]),
    }
    run_file = work / "run.json"
    if run_file.is_file():
        before = json.loads(run_file.read_text())
        changed = [
            k
            for k in ("seed", "max_new", "rows", "prompts", "feature_layers")
            if before.get(k, [] if k == "feature_layers" else None) != settings[k]
        ]
        if changed:
            raise OptionError(
                f"{work} was made with other settings ({', '.join(changed)}); delete it to restart"
            )
    run_file.write_text(json.dumps(settings, indent=1))

    t0 = time.perf_counter()
    _say(f"sampling {tokens} tokens from {pair.target_path.name} into {work / 'data'}")
    _, shards = generate_data(
        pair,
        fits,
        work / "data",
        tokens=tokens,
        seed=seed,
        rows=DATA_ROWS,
        max_new=max_new,
        taps=taps,
        progress=progress,
    )
    data_seconds = time.perf_counter() - t0
    data = Dataset(work / "data", max_new, shards, layers=bool(taps))
    train_rows, held = data.split()
    config = draft_config(pair.target, taps)
    mx.random.seed(seed)
    if start_from is None:
        vocab_ids = choose_vocab(data, vocab, set(pair.eos_token_ids), pair.vocab_size)
        draft = EagleDraft(config)
        draft.init_from_features(*data.feature_stats())
    else:
        draft, vocab_ids = start_from[0], start_from[1]
        if taps and not draft.feature_layers:
            draft = widen_draft(draft, config, data.feature_stats())
    parts = TargetParts(pair.target, mx.array(vocab_ids, dtype=mx.int32))
    before = agreement(draft, parts, data, held, unroll)
    t1 = time.perf_counter()
    facts = train(
        draft,
        parts,
        data,
        work / "checkpoints",
        epochs=epochs,
        batch_rows=batch_rows,
        lr=lr,
        seed=seed,
        unroll=unroll,
        resume=resume,
        progress=progress,
        rows=train_rows,
    )
    train_seconds = time.perf_counter() - t1
    after = agreement(draft, parts, data, held, unroll)
    _say(f"held-out top-1 agreement by draft position: {before} -> {after}")

    staged = work / "draft"
    shutil.rmtree(staged, ignore_errors=True)
    extra = {"target": pair.target_path.name, "seed": seed}
    save_draft(staged, draft, vocab_ids, config, extra)
    _copy_tokenizer(pair.target_path, staged)
    pair.drafter_factory = load_draft(staged, pair)
    pair.drafter_kind = "eagle"
    _say("evaluating on the built-in prompts (held out from training)")
    report = {
        "kind": "eagle",
        "target": pair.target_path.name,
        "init": settings["init"],
        "data": {
            "tokens": data.tokens(),
            "rows": len(data),
            "prompts": len(fits),
            "seconds": round(data_seconds, 1),
        },
        "vocab": {"size": len(vocab_ids), "coverage": _coverage(data, vocab_ids)},
        "training": {**facts, "seconds": round(train_seconds, 1)},
        "agreement_top1_by_position": {"before": before, "after": after},
        "parameters": sum(v.size for _, v in _params(draft)),
        "evaluation": evaluate(pair, max_tokens=eval_tokens, seed=seed, progress=progress),
    }
    report = {"summary": summarise(report), **report}
    (staged / "report.json").write_text(json.dumps(report, indent=1))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(staged, out)
    _say(f"wrote {out}")
    return out


def widen_draft(draft: Any, config: dict, stats: tuple[mx.array, mx.array]) -> Any:
    """A draft that reads the tapped layers of `config` too, made from one that reads the final
    features only: the same layer and fc, the tapped layers standardised with the data's
    statistics, and a projection that starts by passing the final features through, so it
    predicts exactly what `draft` did until training teaches it to use the other layers."""
    from mlx.utils import tree_unflatten

    from ..engine.eagle import EagleDraft

    wide = EagleDraft(config)
    h = draft.hidden_size
    width = wide.feature_mean.size
    kept = [(k, v) for k, v in _params(draft) if not k.startswith("feature_")]
    wide.update(tree_unflatten(kept))
    mean, std = stats
    wide.init_from_features(
        mx.concatenate([mean[: width - h], draft.feature_mean]),
        mx.concatenate([std[: width - h], draft.feature_std]),
    )
    wide.proj.weight = mx.concatenate([mx.zeros((h, width - h)), mx.eye(h)], axis=1)
    wide.proj.bias = mx.zeros((h,))
    mx.eval(wide.parameters())
    return wide


def _init_draft(init: str, pair: Any) -> tuple[Any, list[int], Path]:
    """(draft, vocabulary ids, directory) of the eagle draft a run continues, checked against
    the target: ModelError for a missing directory, one that is no eagle draft, another width,
    or ids the target does not have."""
    from ..engine.eagle import read_draft_for
    from ..models.store import resolve_model

    path = resolve_model(init)
    draft, vocab_ids, _ = read_draft_for(path, pair.target)
    ids = vocab_ids.tolist()
    if max(ids) >= pair.vocab_size:
        raise ModelError(
            f"{path} proposes ids that {pair.target_path.name}'s vocabulary does not have"
        )
    return draft, ids, path


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


def _params(module: Any) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _coverage(data: Dataset, vocab_ids: list[int]) -> float:
    """Share of the sampled answer ids that the draft's vocabulary contains."""
    keep = np.zeros(max(vocab_ids) + 1, bool)
    keep[vocab_ids] = True
    ids = np.concatenate([i[f + 2 :] for i, f in zip(data.ids, data.first, strict=True)])
    return round(float(keep[np.minimum(ids, len(keep) - 1)].mean()), 4) if ids.size else 0.0


def _run(args: argparse.Namespace) -> int:
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    distill(**options)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "distill",
        help="train a draft for a target from the target itself (EAGLE-style)",
        description="Sample continuations from TARGET, train a feature-level draft on its hidden "
        "states, evaluate it on held-out prompts and write it (with report.json) to -o NAME.",
    )
    p.add_argument("target", help="target model: a directory or a store name")
    p.add_argument("-o", "--output", required=True, help="draft name in the store, or a directory")
    p.add_argument("--kind", default="eagle", choices=["eagle"], help="draft kind")
    p.add_argument("--tokens", type=int, default=60_000, help="target tokens to sample")
    p.add_argument("--prompts", default=None, help="extra training prompts (text/JSON/JSONL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-rows", type=int, default=16, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument(
        "--vocab", type=int, default=8192, help="ids the draft may propose (most frequent); 0 = all"
    )
    p.add_argument("--max-new", type=int, default=128, help="tokens sampled per continuation")
    p.add_argument(
        "--unroll",
        type=int,
        default=2,
        help="training passes on the draft's own predicted features",
    )
    p.add_argument(
        "--feature-layers",
        default=None,
        help="target layers the draft reads besides the final features: auto (a low, a middle "
        "and a high one; the default), none, or indices such as 2,15,27 (with --init: that "
        "draft's layers, or layers for a draft that has none)",
    )
    p.add_argument("--eval-tokens", type=int, default=96, help="tokens per evaluation prompt")
    p.add_argument(
        "--init",
        metavar="DRAFT",
        help="continue training this eagle draft (its weights, vocabulary and feature statistics)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=_run)
