"""`macspec bench`'s runs: one method on one prompt, round by round, into a RunRecord (macspec's
methods through the streaming API, mlx-lm's through its own generate steps on its stock models,
llama.cpp's through llamacpp.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ...api.options import GenerationOptions
from ...api.stream import stream_generate
from ...cpu import kernels
from .llamacpp import LLAMACPP, LlamaCpp
from .plan import _NEEDS_DRAFT, MLX_LM, Method
from .progress import RunUpdate
from .report import Recorder, RunRecord

# What each macspec method sets besides the run's own options (GenerationOptions fields).
_OPTIONS: dict[str, dict[str, Any]] = {
    "macspec": {"adaptive": False},
    "macspec_tree": {"adaptive": False},
    "macspec_adaptive": {},
    "macspec_ngram": {},
    "macspec_mtp": {"adaptive": False},  # fixed K, as "macspec": the heads at each K
    "macspec_plain": {"speculative": False},
}


class Runner:
    """Holds the loaded pairs and runs one method on one prompt.

    `pairs`: "model" (the draft model alone: mlx-lm's methods, macspec fixed K and plain),
    "default" (macspec's own default drafting: adaptive K), "ngram" (no draft model), "mtp" (the
    target's own MTP heads)."""

    def __init__(self, pairs: dict[str, Any], max_tokens: int):
        self.pairs = pairs
        self.pair = pairs["model"]
        self.max_tokens = max_tokens
        self.llamacpp: LlamaCpp | None = None  # llama.cpp's servers, when its rows run

    def pair_for(self, method: str) -> Any:
        return self.pairs[
            {"macspec_adaptive": "default", "macspec_ngram": "ngram", "macspec_mtp": "mtp"}.get(
                method, "model"
            )
        ]

    def run(
        self, m: Method, prompt_ids: list[int], temperature: float, seed: int, rec: RunRecord
    ) -> Iterator[Recorder]:
        """Run one method on one prompt into `rec`, yielding its Recorder after each round."""
        # Other methods' pairs stay loaded: count this method's weights plus what the run added.
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        if m.method not in LLAMACPP and m.method not in MLX_LM:
            # Every run reads its prompt whole (its time to the first token is a prefill's), as
            # llama.cpp's (cache_prompt off) and mlx-lm's rows do.
            prompt_cache = self.pair_for(m.method).prompt_cache
            if prompt_cache is not None:
                prompt_cache.clear()
        counter = Recorder(rec)
        if m.method in LLAMACPP:  # not MLX: its memory is not counted here
            peer = self.llamacpp
            yield from peer.run(m.method, m.num_draft, prompt_ids, temperature, seed, counter)
            counter.finish()
            return
        if m.method in MLX_LM:
            # mlx-lm's rows run the models as mlx-lm loads them, without macspec's CPU kernels.
            with kernels.stock(self.pair.target, self.pair.draft):
                yield from self._mlx_lm(m, prompt_ids, temperature, seed, counter)
        else:
            yield from self._macspec(m, prompt_ids, temperature, seed, counter)
        counter.finish()
        pair = self.pair_for(m.method)
        weights = nbytes(pair.target)
        if m.method in _NEEDS_DRAFT and pair.draft is not None:
            weights += nbytes(pair.draft)
        rec.peak_memory = int(mx.get_peak_memory() - resident + weights)

    def _macspec(
        self, m: Method, ids: list[int], temperature: float, seed: int, c: Recorder
    ) -> Iterator[Recorder]:
        opts = GenerationOptions(
            max_tokens=self.max_tokens,
            temperature=temperature,
            seed=seed,
            num_draft=max(m.num_draft, 1),
            tree_nodes=m.tree_nodes,
            **_OPTIONS[m.method],
        )
        draft = verify = 0.0
        first = True
        for ev in stream_generate(self.pair_for(m.method), ids, **opts.to_dict()):
            c.round(len(ev.emitted), ev.num_draft, len(ev.accepted), time.perf_counter(), ev.rows)
            yield c
            if not first:
                draft += ev.draft_time
                verify += ev.verify_time
            first = False
            c.rec.text += ev.text
        c.rec.draft_time, c.rec.verify_time = draft, verify

    def _mlx_lm(
        self, m: Method, ids: list[int], temperature: float, seed: int, c: Recorder
    ) -> Iterator[Recorder]:
        from mlx_lm.generate import generate_step, speculative_generate_step
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        prompt = mx.array(ids, mx.uint32)
        sampler = make_sampler(temp=temperature)
        eos = set(self.pair.eos_token_ids)
        detok = self.pair.tokenizer.detokenizer
        detok.reset()
        if m.method == "mlx_lm":
            steps = generate_step(
                prompt, self.pair.target, max_tokens=self.max_tokens, sampler=sampler
            )
            for token, _ in steps:
                token = int(token)
                if token in eos:
                    c.round(0, 0, 0, time.perf_counter())
                    break
                detok.add_token(token)
                c.round(1, 0, 0, time.perf_counter())
                yield c
        else:
            steps = speculative_generate_step(
                prompt,
                self.pair.target,
                self.pair.draft,
                num_draft_tokens=m.num_draft,
                max_tokens=self.max_tokens,
                sampler=sampler,
            )
            # mlx-lm yields a round's accepted drafts (from_draft=True) then the target's token.
            run = emitted = 0
            for token, _, from_draft in steps:
                token = int(token)
                stop = token in eos
                if not stop:
                    detok.add_token(token)
                    emitted += 1
                if from_draft:
                    run += 1
                if not from_draft or stop:
                    drafted = min(m.num_draft, max(self.max_tokens - c.rec.tokens - 1, 1))
                    c.round(emitted, drafted, run, time.perf_counter())
                    yield c
                    run = emitted = 0
                if stop:
                    break
            if emitted:  # max_tokens reached inside a round of accepted drafts
                c.round(emitted, m.num_draft, run, time.perf_counter())
                yield c
        detok.finalize()
        c.rec.text = detok.text


def run_events(
    runner: Runner, m: Method, ids: list[int], rec: RunRecord, phase: str, n: int, total: int
) -> Iterator[RunUpdate]:
    """One run into `rec`, with its progress after each round and once done."""

    def update(tok_s: float, done: bool) -> RunUpdate:
        return RunUpdate(
            phase, n, total, m.label, rec.prompt, rec.temperature, rec.repeat, rec.tokens, tok_s,
            done,
        )  # fmt: skip

    for counter in runner.run(m, ids, rec.temperature, rec.seed, rec):
        yield update(counter.rate(time.perf_counter()), False)
    yield update(rec.decode_tokens / rec.decode_time if rec.decode_time else 0.0, True)


def nbytes(module: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
