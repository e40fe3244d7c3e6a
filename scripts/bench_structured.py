"""Structured output's cost: tok/s of unconstrained and json_schema-constrained generation,
plain and speculative, on the same prompts in one run (macspec.generate, greedy).

    python scripts/bench_structured.py [--target DIR --draft DIR] [--repeats 3] [--max-tokens 128]

Prints one line per (prompt, mode) with the median tok/s over repeats and its range, the
acceptance, and the summary: the schema's cost against unconstrained decoding (plain and
speculative) and the share of speculation's speedup the schema keeps.
"""

from __future__ import annotations

import argparse
import statistics

import macspec

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional person as a JSON object with name, age, city and hobbies.",
    "Give me a JSON record of a software engineer: name, age, city and a list of hobbies.",
]


def run(pair, prompt: str, schema, speculative: bool, max_tokens: int) -> tuple[float, float, int]:
    kw = {"json_schema": schema} if schema is not None else {}
    r = macspec.generate(
        pair,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        speculative=speculative,
        **kw,
    )
    return r.stats.tokens_per_second, r.stats.acceptance_rate, r.stats.generated_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    pair = macspec.load(args.target, args.draft) if args.target else macspec.load()
    modes = {
        "plain": (None, False),
        "plain+schema": (PERSON, False),
        "spec": (None, True),
        "spec+schema": (PERSON, True),
    }
    for prompt in PROMPTS:  # warm-up: compiles, the LLTokenizer, the policy's costs
        for schema, spec in modes.values():
            run(pair, prompt, schema, spec, 16)
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    for i, prompt in enumerate(PROMPTS):
        per: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):  # interleaved, so that load on the machine hits all alike
            for m, (schema, spec) in modes.items():
                tps, acc, n = run(pair, prompt, schema, spec, args.max_tokens)
                per[m].append(tps)
                print(f"prompt {i} {m:13s} {tps:6.1f} tok/s  acceptance {acc:.2f}  {n} tokens")
        for m in modes:
            med = statistics.median(per[m])
            print(f"prompt {i} {m:13s} median {med:.1f} [{min(per[m]):.1f}-{max(per[m]):.1f}]")
            speeds[m].append(med)
    mean = {m: statistics.mean(v) for m, v in speeds.items()}
    print(f"schema cost, plain:       {1 - mean['plain+schema'] / mean['plain']:+.1%}")
    print(f"schema cost, speculative: {1 - mean['spec+schema'] / mean['spec']:+.1%}")
    free, constrained = mean["spec"] / mean["plain"], mean["spec+schema"] / mean["plain+schema"]
    print(f"speedup unconstrained {free:.2f}x, under the schema {constrained:.2f}x")
    print(f"speedup kept: {(constrained - 1) / (free - 1):.0%}" if free > 1 else "no speedup")


if __name__ == "__main__":
    main()
