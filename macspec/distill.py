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

from .errors import MacspecError, ModelError, OptionError, PromptError

# Training prompts by kind. The evaluation prompts (macspec.prompts.BUILTIN) are not among them.
TRAIN_PROMPTS: dict[str, tuple[str, ...]] = {
    "chat": (
        "How can I stay focused while working from home?",
        "What are some healthy breakfast ideas?",
        "Why do cats purr?",
        "How do I make a good first impression at a job interview?",
        "What should I pack for a weekend camping trip?",
        "How can I save money on groceries?",
        "What is the best way to start running as a beginner?",
        "Why is exercise good for mental health?",
        "How do I deal with stress before an exam?",
        "What are the benefits of reading books every day?",
        "How can I improve my public speaking skills?",
        "What is a good way to organise my week?",
        "Can you explain what inflation is?",
        "How do vaccines work?",
        "What causes the seasons on Earth?",
        "Why do leaves change colour in autumn?",
        "How does a refrigerator keep food cold?",
        "What is the difference between weather and climate?",
        "How can I be more productive in the morning?",
        "What are some tips for keeping houseplants alive?",
        "How do I apologise to a friend I have hurt?",
        "What are the pros and cons of electric cars?",
        "How do I choose a good password?",
        "What is meditation and how do I start?",
        "Why is drinking water important?",
        "How can I reduce my screen time?",
        "What are some fun things to do on a rainy day?",
        "How does the internet work, in simple terms?",
        "What is photosynthesis?",
        "How do airplanes stay in the air?",
        "What is the difference between a crocodile and an alligator?",
        "Why do we dream?",
        "How can I make friends in a new city?",
        "What are good habits for a healthy heart?",
        "How should I prepare for a long flight?",
        "Why is the ocean salty?",
        "What are the main causes of climate change?",
        "How can I learn to cook?",
        "What does a good night routine look like?",
        "How do I ask my boss for a raise?",
        "What is artificial intelligence?",
        "Why do we have time zones?",
        "How can I help the environment at home?",
        "What is the difference between a star and a planet?",
        "How do bees make honey?",
        "What are some tips for writing a good essay?",
        "How can I stop procrastinating?",
        "What is the best way to memorise new words?",
    ),
    "instruction": (
        "List five fruits that are high in vitamin C.",
        "Give me three ideas for a birthday party for a ten-year-old.",
        "Summarise the water cycle in a few sentences.",
        "Write a short thank-you note to a teacher.",
        "Explain how to change a flat tyre, step by step.",
        "Translate 'good morning, how are you?' into French and Spanish.",
        "Write a polite email asking a colleague to send a report by Friday.",
        "Describe the steps to plant a tree.",
        "Give me a simple recipe for tomato soup.",
        "Make a packing list for a beach holiday.",
        "Explain the rules of chess briefly.",
        "Write three interview questions for a software engineer.",
        "List the planets of the solar system in order.",
        "Give me a workout plan for three days a week.",
        "Write a product description for a reusable water bottle.",
        "Explain how to make a cup of tea.",
        "Give me five tips for a job resume.",
        "Write an agenda for a one-hour team meeting.",
    ),
    "code": (
        "Write a Python function that reverses a string.",
        "Write a Python function to compute the factorial of a number.",
        "Write a Python program that prints the Fibonacci numbers below 100.",
        "How do I read a text file line by line in Python?",
        "Write a JavaScript function that checks whether a string is a palindrome.",
        "Explain what a Python list comprehension is, with an example.",
        "Write a Python class for a simple bank account with deposit and withdraw methods.",
        "Write a SQL query that counts the orders per customer.",
        "What is the difference between a list and a tuple in Python?",
        "Write a bash script that counts the files in a directory.",
        "Write a Python function that sorts a list of dictionaries by a key.",
        "Explain recursion with a simple example in Python.",
        "Write a function in C that returns the maximum of an array of integers.",
        "How do I handle exceptions in Python?",
    ),
    "story": (
        "Write a short story about a robot who learns to paint.",
        "Tell me a story about a dragon who is afraid of the dark.",
        "Write a story about two friends lost in a forest.",
        "Write a short poem about the sea.",
        "Write a bedtime story about a little bear.",
        "Tell a funny story about a cat and a dog.",
        "Write a short story that starts with a knock on the door at midnight.",
        "Write a poem about autumn leaves.",
        "Write a story about a girl who can talk to birds.",
        "Describe a day in the life of a farmer.",
        "Write a short fairy tale about a magic key.",
        "Write a haiku about the moon.",
    ),
    "facts": (
        "Who was Marie Curie?",
        "Tell me about the history of the Roman Empire.",
        "What is the capital of Australia and what is it known for?",
        "Explain how the heart pumps blood.",
        "What is the Great Wall of China?",
        "Who invented the telephone?",
        "What are black holes?",
        "Describe the life cycle of a butterfly.",
        "What is DNA?",
        "Tell me about the Amazon rainforest.",
        "What is the theory of evolution?",
        "How were the pyramids of Egypt built?",
        "What is the speed of light?",
        "Tell me some facts about elephants.",
    ),
}

# Topics x question forms: hundreds of varied contexts cost nothing to write, and the held-out gap
# of the first draft (0.86 agreement on training prompts, 0.30 on others) showed that prompt
# variety, not the number of samples per prompt, limited it.
_TOPICS = (
    "volcanoes",
    "the moon landing",
    "compound interest",
    "sourdough bread",
    "solar panels",
    "the French Revolution",
    "honeybees",
    "machine learning",
    "recycling plastic",
    "jazz music",
    "the human immune system",
    "earthquakes",
    "coffee",
    "the printing press",
    "octopuses",
    "renewable energy",
    "the stock market",
    "ancient Greece",
    "rainbows",
    "sleep",
    "electric guitars",
    "the water cycle",
    "chess openings",
    "glaciers",
    "photosynthesis in algae",
    "the Silk Road",
    "vaccination",
    "bicycles",
    "cloud computing",
    "coral reefs",
    "the Olympic Games",
    "tea ceremonies",
    "nuclear fusion",
    "the Internet of Things",
    "wolves",
    "minimalism",
    "the Renaissance",
    "hurricanes",
    "blockchains",
    "volunteering",
)
_FORMS = (
    "Explain {} to a ten-year-old.",
    "What are three surprising facts about {}?",
    "Write a short paragraph about {} for a school newsletter.",
    "What are the advantages and disadvantages of {}?",
    "Give me a quick summary of the history of {}.",
    "Write a haiku about {}.",
)
_CODE_TASKS = (
    "removes duplicates from a list while keeping the order",
    "counts the words in a sentence",
    "checks whether a year is a leap year",
    "merges two sorted lists",
    "converts Celsius to Fahrenheit",
    "finds the second largest number in a list",
    "returns the n-th triangular number",
    "validates an email address with a regular expression",
    "flattens a nested list",
    "computes the average of the values in a dictionary",
    "capitalises the first letter of every word",
    "returns the longest word in a text",
)
_LANGUAGES = ("Python", "JavaScript", "Go")
_TEXTS = (
    "The museum will close for renovation from June to September. During this time the "
    "collection will travel to three other cities. Members keep their benefits and can visit "
    "the partner museums for free. The new building adds a cafe, a library and a hall for "
    "children's workshops.",
    "our team finished the first version of the app last week. testers found twelve bugs, "
    "most of them small layout problems on older phones. two bugs crash the app when the "
    "network is slow. we plan to fix everything by the end of the month and then release it.",
    "Scientists tracked 40 sea turtles for two years with small satellite tags. The turtles "
    "swam up to 3,000 kilometres between feeding areas and the beaches where they were born. "
    "The study shows that protecting a few coastal areas could help the whole population.",
    "Dear customer, your order 5521 has been shipped and should arrive within five working "
    "days. If a part is missing or damaged, reply to this message with a photo and we will "
    "send a replacement. Thank you for shopping with us.",
)
_TASKS = (
    "Summarise this text in two sentences.",
    "Rewrite this text in a formal tone.",
    "List the key facts in this text as bullet points.",
    "Write three questions that this text answers.",
)
TRAIN_PROMPTS["varied"] = tuple(f.format(t) for t in _TOPICS for f in _FORMS)
TRAIN_PROMPTS["varied code"] = tuple(
    f"Write a {lang} function that {task}." for task in _CODE_TASKS for lang in _LANGUAGES
)
TRAIN_PROMPTS["grounded"] = tuple(f"{task}\n\n{text}" for text in _TEXTS for task in _TASKS)

# Temperatures of the rows sampled for one prompt: one greedy row (the aim is greedy acceptance)
# and a spread of sampled ones, so the draft sees the contexts it meets at every temperature.
TEMPERATURE_CYCLES = (
    (0.0, 0.5, 0.8, 1.0),
    (0.3, 0.6, 0.7, 0.9),
    (0.2, 0.7, 1.0, 1.0),
    (0.4, 0.6, 0.8, 0.9),
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


def _trunk(model: Any, inputs: mx.array, cache: list, mask: mx.array) -> mx.array:
    """The decoder trunk with an explicit boolean attention mask (for left-padded batches).

    RoPE scores depend only on relative positions, so a left-padded row whose pad columns are
    masked out sees exactly what it would see alone. Needs the mlx-lm layout every llama-like
    model uses: model.model.embed_tokens / layers / norm, layer(h, mask, cache)."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    for layer, c in zip(inner.layers, cache, strict=True):
        h = layer(h, mask, cache=c)
    return inner.norm(h)


def sample_rows(
    model: Any,
    prompts: list[list[int]],
    temps: list[float],
    max_new: int,
    key: mx.array,
    eos: set[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sample one continuation per (prompt, temperature) row, all rows in one left-padded batch.

    Returns tokens (B, L), hidden (B, L, H) float32 (the target's final hidden state at every
    position), starts (B,) (first real position) and ends (B,) (one past the last kept id)."""
    from mlx_lm.models.cache import make_prompt_cache

    from .engine import output_head

    rows, width = len(prompts), max(map(len, prompts))
    starts = np.array([width - len(p) for p in prompts], np.int32)
    padded = np.zeros((rows, width), np.int32)
    for r, p in enumerate(prompts):
        padded[r, starts[r] :] = p
    real = mx.array(np.arange(width)[None] >= starts[:, None])  # (B, width) non-pad columns
    causal = mx.tril(mx.ones((width, width), dtype=mx.bool_))
    cache = make_prompt_cache(model)
    h = _trunk(model, mx.array(padded), cache, (causal[None] & real[:, None, :])[:, None])
    hidden, tokens = [h.astype(mx.float16)], []
    t = mx.array(temps, dtype=mx.float32)
    greedy, safe_t = t == 0, mx.where(t == 0, 1.0, t)[:, None]
    for step_key in mx.random.split(key, max_new):
        logits = output_head(model, h[:, -1]).astype(mx.float32)
        sampled = mx.random.categorical(logits / safe_t, key=step_key)
        nxt = mx.where(greedy, mx.argmax(logits, axis=-1), sampled).astype(mx.int32)
        real = mx.concatenate([real, mx.ones((rows, 1), mx.bool_)], axis=1)
        h = _trunk(model, nxt[:, None], cache, real[:, None, None, :])
        tokens.append(nxt)
        hidden.append(h.astype(mx.float16))
        mx.eval(nxt, hidden[-1])
    gen = np.array(mx.stack(tokens, axis=1))
    ends = np.full(rows, width + max_new, np.int32)
    for r in range(rows):
        stop = np.nonzero(np.isin(gen[r], list(eos)))[0]
        if stop.size:
            ends[r] = width + stop[0] + 1  # keep the EOS: predicting it matters
    full = np.concatenate([padded, gen], axis=1)
    return full, np.array(mx.concatenate(hidden, axis=1).astype(mx.float32)), starts, ends


def data_jobs(prompts: list[list[int]], seed: int, rows: int) -> list[list[tuple[int, float]]]:
    """Batches of (prompt index, temperature) rows, cycling over the prompts with new temperatures.

    Each prompt gets one greedy row overall (greedy continuations repeat themselves) and sampled
    rows over a spread of temperatures, so the draft meets the contexts of every setting."""
    rng = np.random.default_rng(seed)
    jobs: list[list[tuple[int, float]]] = []
    for temps in TEMPERATURE_CYCLES:
        order = rng.permutation(len(prompts))
        # Similar lengths together: less padding to compute.
        order = sorted(order, key=lambda i: len(prompts[i]) // 16)
        cells = [(int(i), t) for i in order for t in temps]
        jobs += [cells[k : k + rows] for k in range(0, len(cells), rows)]
    return jobs


def generate_data(
    pair: Any,
    prompts: list[list[int]],
    data_dir: Path,
    *,
    tokens: int,
    seed: int,
    rows: int = 32,
    max_new: int = 128,
    progress: bool = True,
) -> tuple[int, int]:
    """Write shards until they hold `tokens` generated tokens; existing shards are kept (resume).
    Returns (generated tokens, shards used).

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
            toks, hid, starts, ends = sample_rows(
                pair.target, batch, [t for _, t in job], max_new, key, eos
            )
            width = toks.shape[1] - max_new
            meta = {"generated": int((ends - width).sum())}
            arrays = {
                "tokens": mx.array(toks),
                "hidden": mx.array(hid).astype(mx.float16),
                "starts": mx.array(starts),
                "ends": mx.array(ends),
            }
            _save_atomic(shard, arrays, {k: str(v) for k, v in meta.items()})
            made += meta["generated"]
        have += meta["generated"]
        j += 1
        if progress:
            rate = made / max(time.perf_counter() - start, 1e-9)
            eta = (tokens - have) / rate if rate > 0 else float("nan")
            _bar("data", min(have, tokens), tokens, f"{rate:.0f} tok/s  ETA {_hms(eta)}")
    if progress:
        print(file=sys.stderr)
    return have, j


def _shard_meta(path: Path) -> dict:
    from .store import _safetensors_header

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

    def __init__(self, data_dir: Path, max_new: int, shards: int | None = None):
        self.ids: list[np.ndarray] = []
        self.feats: list[np.ndarray] = []
        self.first: list[int] = []  # draft positions before this predict prompt ids: no loss
        self.prompt: list[int] = []  # which prompt each row continues (a hash of its ids)
        # Only the shards this run counted: a longer earlier run may have left more.
        found = sorted(data_dir.glob("shard-[0-9][0-9][0-9][0-9][0-9].safetensors"))
        for shard in found[:shards]:
            arrays = mx.load(str(shard))
            toks = np.array(arrays["tokens"])
            hid = np.array(arrays["hidden"])  # float16
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
        f = np.concatenate(self.feats)[:limit].astype(np.float32)
        return mx.array(f.mean(0)), mx.array(f.std(0) + 1e-3)

    def tokens(self) -> int:
        return sum(len(i) - f - 1 for i, f in zip(self.ids, self.first, strict=True))

    def batch(self, rows: list[int]) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(features (B, L, H), next ids (B, L), target features (B, L, H), flat indices of the
        positions whose loss counts) for draft positions t = 0..L-1 of each row, right-padded."""
        length = max(len(self.ids[r]) - 1 for r in rows)
        h = self.feats[rows[0]].shape[1]
        feats = np.zeros((len(rows), length, h), np.float32)
        target = np.zeros_like(feats)
        nxt = np.zeros((len(rows), length), np.int32)
        mask = np.zeros((len(rows), length), np.float32)
        for b, r in enumerate(rows):
            n = len(self.ids[r]) - 1
            feats[b, :n] = self.feats[r][:-1]
            target[b, :n] = self.feats[r][1:]
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
    inputs = feats
    for step in range(unroll):
        g = draft(inputs, embeds)
        gk = g.reshape(-1, h)[where]
        logq = nn_log_softmax(gk @ head.T)
        ce = -(p * logq).sum(-1)
        diff = mx.abs(gk - tgt) / draft.feature_std  # in standardised units
        reg = mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)  # smooth L1
        total = total + (ce + reg_weight * reg).mean()
        if step == 0:
            agree = (mx.argmax(logq, axis=-1) == best).mean()
        # Position t now reads g_{t-1} (the prediction of f_t) in place of f_t.
        inputs = mx.concatenate([feats[:, :1], g[:, :-1]], axis=1)
    return total / unroll, agree


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
        inputs = feats
        for step in range(unroll):
            g = draft(inputs, embeds)
            hit = (mx.argmax(g.reshape(-1, h)[where] @ parts.head.T, axis=-1) == best).sum()
            if len(out) <= step:
                out.append([0.0, 0.0])
            out[step][0] += hit.item()
            out[step][1] += where.size
            inputs = mx.concatenate([feats[:, :1], g[:, :-1]], axis=1)
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
    from .api import generate
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
    from .api import generate

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
    from .store import _looks_like_path, store_root, validate_name

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
    Returns the draft's directory."""
    from .api import load
    from .eagle import EagleDraft, TargetParts, draft_config, load_draft, save_draft

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
    ids = training_prompts(pair, prompts)  # raises PromptError for a bad prompt file
    fits = [p for p in ids if len(p) + max_new < pair.context_length]
    if not fits:
        raise PromptError(f"no training prompt fits the target's context of {pair.context_length}")
    _writable(work)
    settings = {
        "target": str(pair.target_path),
        "seed": seed,
        "max_new": max_new,
        "rows": 32,
        "prompts": len(fits),
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
            k for k in ("seed", "max_new", "rows", "prompts") if before.get(k) != settings[k]
        ]
        if changed:
            raise OptionError(
                f"{work} was made with other settings ({', '.join(changed)}); delete it to restart"
            )
    run_file.write_text(json.dumps(settings, indent=1))

    t0 = time.perf_counter()
    _say(f"sampling {tokens} tokens from {pair.target_path.name} into {work / 'data'}")
    _, shards = generate_data(
        pair, fits, work / "data", tokens=tokens, seed=seed, max_new=max_new, progress=progress
    )
    data_seconds = time.perf_counter() - t0
    data = Dataset(work / "data", max_new, shards)
    train_rows, held = data.split()
    config = draft_config(pair.target)
    mx.random.seed(seed)
    if start_from is None:
        vocab_ids = choose_vocab(data, vocab, set(pair.eos_token_ids), pair.vocab_size)
        draft = EagleDraft(config)
        draft.init_from_features(*data.feature_stats())
    else:
        draft, vocab_ids = start_from[0], start_from[1]
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


def _init_draft(init: str, pair: Any) -> tuple[Any, list[int], Path]:
    """(draft, vocabulary ids, directory) of the eagle draft a run continues, checked against
    the target: ModelError for a missing directory, one that is no eagle draft, another width,
    or ids the target does not have."""
    from .eagle import read_draft_for
    from .store import resolve_model

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
    p.add_argument("--eval-tokens", type=int, default=96, help="tokens per evaluation prompt")
    p.add_argument(
        "--init",
        metavar="DRAFT",
        help="continue training this eagle draft (its weights, vocabulary and feature statistics)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=_run)
