"""What a pruned draft head (macspec/core/drafters/pruned.py) covers and what it saves.

    python scripts/draft_head.py cost [--sizes 0,16384,32768,65536]
        a target step and the draft's proposals of 3 ids (fixed and adaptive length, T=0 and
        0.7) per drafted id, interleaved in one process, best of --repeats
    python scripts/draft_head.py coverage --output tokens.json
        the target's own greedy output on scripts/code_prompts.jsonl and the built-in prompts,
        and the share of it each size of head covers

Both load the pair (default: the store's qwen2.5-coder-1.5b and -0.5b); run timings on a quiet
machine, without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE set."""

import macspec  # noqa: I001  first, so that it loads OpenBLAS before mlx
import argparse
import json
import time
from collections import defaultdict

import mlx.core as mx

from macspec.core.drafters.model import ModelDrafter
from macspec.core.drafters.pruned import frequent_ids, prune_head
from macspec.core.sampling import SamplingOptions
from macspec.core.target import Target
from macspec.core.round import Step, alone, chain_round
from macspec.core.verify import make_dist
from macspec.api.drafters import special_ids
from macspec.tools.prompts import builtin_prompts, load_prompts

TEXT = "Write a Python function that reads a CSV file and sums a column. " * 4
COVERAGE_SIZES = (4096, 8192, 16384, 24576, 32768, 49152, 65536)


def cost(pair: macspec.Pair, sizes: list[int], repeats: int, k: int = 3) -> None:
    vocab = pair.vocab_size
    heads = {s: prune_head(pair.draft, vocab, s, special_ids(pair)) for s in sizes}
    prompt = pair.tokenizer.encode(TEXT)
    target, best = Target(pair.target, vocab), {}
    for rep in range(repeats + 1):  # the first round warms up
        for temp in (0.0, 0.7):
            dist = make_dist(SamplingOptions(temperature=temp), prompt)
            target.start(prompt, max_step=k + 1)
            t0 = time.perf_counter()
            alone(chain_round(target, None, Step(prompt[-1], 0, dist, mx.random.key(rep), t0)))
            if rep:
                best[temp, "target step", "-"] = min(
                    best.get((temp, "target step", "-"), 1e9), time.perf_counter() - t0
                )
            for stop in (0.0, 0.3):
                for s in sizes:
                    drafter = ModelDrafter(pair.draft, vocab, stop, heads[s])
                    drafter.start(prompt, max_step=k + 1)
                    t0 = time.perf_counter()
                    p = drafter.propose(k, dist, mx.random.key(rep))
                    mx.eval(p.tokens, p.probs if p.probs is not None else [])
                    seconds = (time.perf_counter() - t0) / p.tokens.size
                    key = (temp, f"draft, stop below {stop}", s or "every id")
                    if rep:
                        best[key] = min(best.get(key, 1e9), seconds)
    for (temp, what, head), seconds in sorted(best.items(), key=str):
        step = best[temp, "target step", "-"]
        print(
            f"T={temp} {what:22s} head {head!s:>8}: {seconds * 1000:6.2f} ms "
            f"({seconds / step:.3f} of a target step)"
        )


def coverage(pair: macspec.Pair, output: str) -> None:
    prompts = load_prompts("scripts/code_prompts.jsonl") + builtin_prompts()
    tokens = {}
    for i, p in enumerate(prompts):
        r = macspec.generate(pair, messages=p.messages, max_tokens=128, temperature=0.0)
        tokens[f"{i}-{p.name}/{p.kind}"] = r.tokens
    keep = special_ids(pair)
    shares = {}
    for size in COVERAGE_SIZES:
        ids = set(frequent_ids(size, pair.vocab_size, keep).tolist())
        by_kind = defaultdict(lambda: [0, 0])
        for name, ts in tokens.items():
            for kind in ("all", name.split("/")[1]):
                by_kind[kind][0] += sum(t in ids for t in ts)
                by_kind[kind][1] += len(ts)
        shares[size] = {kind: round(a / b, 4) for kind, (a, b) in by_kind.items()}
        print(size, shares[size])
    with open(output, "w") as f:
        json.dump({"vocab_size": pair.vocab_size, "tokens": tokens, "coverage": shares}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("cost", "coverage"))
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--sizes", default="0,16384,32768,65536", help="cost: head sizes (0: all)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--output", default="draft_head_tokens.json", help="coverage: tokens file")
    args = ap.parse_args()
    # Coverage: greedy output is the target's whatever the draft's head (exact speculation).
    pair = macspec.load(args.target, args.draft, drafter="model", measure=False)
    if args.what == "cost":
        cost(pair, [int(s) for s in args.sizes.split(",")], args.repeats)
    else:
        coverage(pair, args.output)


if __name__ == "__main__":
    main()
