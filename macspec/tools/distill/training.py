"""Training the EAGLE draft by distillation: the loss, the unrolled drafting steps, AdamW with
checkpoints that resume exactly, and the starting draft (fresh, continued with --init, widened).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ...base.errors import ModelError
from ...core.drafters.eagle import EagleDraft
from ...models.draft_files import read_draft_for
from ...models.store import resolve_model
from .data import Dataset, choose_vocab, save_atomic
from .progress import bar, end_bar, hms, say


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
        out = out.reshape(-1, out.shape[-1])[where]
        logq = log_softmax(draft.logits(out, head))
        loss = -(p * logq).sum(-1)
        if reg_weight:  # the eagle kind predicts the target's features: regress them too
            diff = mx.abs(draft.decode(out) - tgt) / draft.feature_std[-h:]  # standardised
            loss = loss + reg_weight * mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
        total = total + loss.mean()
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
    b, n, _ = embeds.shape
    pos = mx.arange(n)
    blocks = draft.blocks
    keys: list[list[mx.array]] = [[] for _ in blocks]  # per layer, per step
    values: list[list[mx.array]] = [[] for _ in blocks]
    outs = []

    def heads(x: mx.array, count: int) -> mx.array:
        return x.reshape(b, n, count, -1).transpose(0, 2, 1, 3)

    def shifted(x: mx.array, by: int) -> mx.array:  # x[t - by] at t (zeros before the start)
        if by == 0:
            return x
        return mx.concatenate([mx.zeros_like(x[:, :, :by]), x[:, :, : n - by]], axis=2)

    for s in range(steps):
        # Real keys up to the anchor (at least key 0, so rows without an anchor stay finite;
        # their positions carry no loss).
        real = pos[None, :] <= mx.maximum(pos[:, None] - s, 0)
        for i, (block, ks, vs) in enumerate(zip(blocks, keys, values, strict=True)):
            attn = block.self_attn
            repeat = attn.n_heads // attn.n_kv_heads
            if i == 0:
                x, h = draft.first_input(embeds, state)
            else:
                h = block.input_layernorm(x)
            q = attn.rope(heads(attn.q_proj(h), attn.n_heads)) * attn.scale
            ks.append(mx.repeat(attn.rope(heads(attn.k_proj(h), attn.n_kv_heads)), repeat, axis=1))
            vs.append(mx.repeat(heads(attn.v_proj(h), attn.n_kv_heads), repeat, axis=1))
            scores = [mx.where(real, q @ ks[0].transpose(0, 1, 3, 2), -mx.inf)]
            diag = []
            for r in range(1, s + 1):
                k_r, v_r = shifted(ks[r], s - r), shifted(vs[r], s - r)
                score = (q * k_r).sum(-1, keepdims=True)
                scores.append(mx.where((pos >= s - r)[:, None], score, -mx.inf))
                diag.append(v_r)
            w = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
            o = w[..., :n] @ vs[0]
            for r, v_r in enumerate(diag):
                o = o + w[..., n + r : n + r + 1] * v_r
            x = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        outs.append(x)
        # Position t's next state: this step's prediction made at t - 1.
        state = mx.concatenate([state[:, :1], draft.recycle(x)[:, :-1]], axis=1)
    return outs


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def lr_schedule(lr: float, steps: int, warmup: int) -> Callable:
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
    checkpoint_seconds: float = 600.0,
    progress: bool = True,
    rows: list[int] | None = None,
) -> dict:
    """AdamW with warm-up and cosine decay; returns training facts for the report.

    The batch order of epoch e is a permutation seeded by (seed, e), and checkpoints hold the
    weights, the optimizer state and the step, so a resumed run takes the very same steps."""
    train_rows = list(range(len(data))) if rows is None else rows
    per_epoch = max(1, math.ceil(len(train_rows) / batch_rows))
    steps = epochs * per_epoch
    warmup = min(max(10, steps // 10), steps // 2)
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=0.01)
    head = parts.head
    loss_and_grad = nn.value_and_grad(
        draft, lambda b: _loss(draft, head, parts.embed, b, reg_weight, unroll)
    )
    step = _resume(draft, opt, ckpt_dir, steps) if resume else 0
    mx.eval(draft.parameters())
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start, done_tokens, ema_loss, ema_acc = time.perf_counter(), 0, None, None
    saved = start
    first = step
    while step < steps:
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(train_rows)
        batch = data.batch(order[i * batch_rows : (i + 1) * batch_rows].tolist())
        loss, acc = _step(draft, opt, loss_and_grad, batch)
        step += 1
        done_tokens += batch[3].size
        ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
        ema_acc = acc.item() if ema_acc is None else 0.9 * ema_acc + 0.1 * acc.item()
        # Every `checkpoint_every` steps, or `checkpoint_seconds`: a real target's steps take
        # about a minute each here, and a stopped run should lose minutes, not an hour.
        now = time.perf_counter()
        if step % checkpoint_every == 0 or step == steps or now - saved >= checkpoint_seconds:
            _save(draft, opt, ckpt_dir, step, steps)
            saved = now
        if progress:
            elapsed = time.perf_counter() - start
            eta = hms(elapsed / (step - first) * (steps - step))
            speed = f"{done_tokens / max(elapsed, 1e-9):.0f} tok/s  ETA {eta}"
            bar("train", step, steps, f"step {step}/{steps}  {_ema(ema_loss, ema_acc)}  {speed}")
    if progress:
        end_bar()
    facts = {"steps": steps, "epochs": epochs, "batch_rows": batch_rows, "lr": lr}
    return {**facts, "unroll": unroll, "reg_weight": reg_weight, "final_loss": ema_loss}


def _ema(loss: float, acc: float) -> str:
    return f"loss {loss:.3f}  top1 {acc:.2f}"


def _step(draft: Any, opt: optim.Optimizer, loss_and_grad: Callable, batch: tuple) -> tuple:
    """One optimizer step on `batch`: (loss, top-1 agreement), evaluated."""
    (loss, acc), grads = loss_and_grad(batch)
    grads, _ = optim.clip_grad_norm(grads, 1.0)
    opt.update(draft, grads)
    mx.eval(draft.parameters(), opt.state, loss, acc)
    return loss, acc


def _resume(draft: Any, opt: optim.Optimizer, ckpt_dir: Path, steps: int) -> int:
    """The step a checkpoint in `ckpt_dir` left off at (its weights and optimizer state
    restored), or 0 without one."""
    ckpt = ckpt_dir / "checkpoint.safetensors"
    if not ckpt.is_file():
        return 0
    saved = mx.load(str(ckpt))
    draft.load_weights([(k[6:], v) for k, v in saved.items() if k.startswith("model.")])
    opt.init(draft.trainable_parameters())
    opt.state = tree_unflatten([(k[4:], v) for k, v in saved.items() if k.startswith("opt.")])
    step = int(json.loads((ckpt_dir / "checkpoint.json").read_text())["step"])
    say(f"resuming training at step {step}/{steps}")
    return step


def _save(draft: Any, opt: optim.Optimizer, ckpt_dir: Path, step: int, steps: int) -> None:
    arrays = {f"model.{k}": v for k, v in tree_flatten(draft.parameters())}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    save_atomic(ckpt_dir / "checkpoint.safetensors", arrays)
    (ckpt_dir / "checkpoint.json").write_text(json.dumps({"step": step, "steps": steps}))


def keep_vocab(ckpt_dir: Path, vocab_ids: list[int]) -> None:
    """Write the ids the draft's head covers beside its checkpoints: a resumed run with more
    data would choose others, and the trained head's rows would then stand for other ids."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / "vocab.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([int(i) for i in vocab_ids]))
    tmp.replace(path)


def kept_vocab(ckpt_dir: Path) -> list[int] | None:
    """The ids a checkpoint in `ckpt_dir` was trained over (None: no checkpoint yet).
    ModelError for a checkpoint without them (written before they were kept), whose head's
    ids cannot be known once the data has grown."""
    path = ckpt_dir / "vocab.json"
    if not (ckpt_dir / "checkpoint.safetensors").is_file():
        return None
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(
            f"{ckpt_dir / 'checkpoint.safetensors'} has no readable {path.name} ({e}): the ids "
            "its head was trained over are unknown; start afresh (delete the directory)"
        ) from e
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ModelError(f"{path}: not a list of token ids")
    return ids


def start_draft(
    data: Dataset,
    config: dict,
    vocab: int,
    pair: Any,
    start_from: tuple[Any, list[int], Path] | None = None,
    vocab_ids: list[int] | None = None,
) -> tuple[Any, list[int]]:
    """(draft, vocabulary ids) training starts from: a fresh draft over `vocab_ids` (default
    the `vocab` ids most frequent in the data), or `start_from` (see init_draft), widened when
    `config` taps layers that draft does not read."""
    if start_from is None:
        if vocab_ids is None:
            vocab_ids = choose_vocab(data, vocab, set(pair.eos_token_ids), pair.vocab_size)
        draft = EagleDraft(config)
        draft.init_from_features(*data.feature_stats())
        return draft, vocab_ids
    draft, vocab_ids = start_from[0], start_from[1]
    if config["feature_layers"] and not draft.feature_layers:
        draft = widen_draft(draft, {**config, "layers": len(draft.blocks)}, data.feature_stats())
    if config["layers"] > len(draft.blocks):
        draft = deepen_draft(draft, config)
    return draft, vocab_ids


def deepen_draft(draft: Any, config: dict) -> Any:
    """`draft` with the decoder layers `config` adds after its own, each starting as the
    identity (its attention and MLP output projections zero, so the residual passes through):
    it predicts exactly what `draft` did until training teaches the new layers a correction."""
    deep = EagleDraft(config)
    deep.update(tree_unflatten(params(draft)))  # its feature statistics too (frozen, not gone)
    for block in deep.blocks[len(draft.blocks) :]:
        block.self_attn.o_proj.weight = mx.zeros_like(block.self_attn.o_proj.weight)
        block.mlp.down_proj.weight = mx.zeros_like(block.mlp.down_proj.weight)
    mx.eval(deep.parameters())
    return deep


def widen_draft(draft: Any, config: dict, stats: tuple[mx.array, mx.array]) -> Any:
    """A draft that reads the tapped layers of `config` too, made from one that reads the final
    features only: the same layer and fc, the tapped layers standardised with the data's
    statistics, and a projection that starts by passing the final features through, so it
    predicts exactly what `draft` did until training teaches it to use the other layers."""
    wide = EagleDraft(config)
    h = draft.hidden_size
    width = wide.feature_mean.size
    kept = [(k, v) for k, v in params(draft) if not k.startswith("feature_")]
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


def init_draft(init: str, pair: Any) -> tuple[Any, list[int], Path]:
    """(draft, vocabulary ids, directory) of the eagle draft a run continues, checked against
    the target: ModelError for a missing directory, one that is no eagle draft, another width,
    or ids the target does not have."""
    path = resolve_model(init)
    draft, vocab_ids, _ = read_draft_for(path, pair.target)
    ids = vocab_ids.tolist()
    if max(ids) >= pair.vocab_size:
        raise ModelError(
            f"{path} proposes ids that {pair.target_path.name}'s vocabulary does not have"
        )
    return draft, ids, path


def params(module: Any) -> list:
    return tree_flatten(module.parameters())
