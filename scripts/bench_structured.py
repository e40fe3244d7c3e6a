"""Structured output's cost: tok/s of unconstrained and constrained generation, plain and
speculative, on the same prompts in one run (macspec.generate, greedy).

    python scripts/bench_structured.py [--target DIR --draft DIR] [--repeats 3] [--max-tokens 160]
        [--prompts 0 1]

Two constraints: "any", a grammar every text satisfies, so the constrained answer is token for
token the unconstrained one (checked) and acceptance is equal: what the masks themselves cost;
and "schema", a JSON schema of a list of four people (its answer differs, acceptance is shown).
One line per run, then per prompt the median tok/s over repeats and its range, then the cost
against unconstrained decoding and the share of speculation's speedup kept.
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
PEOPLE = {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 4}
ANY = "start: /(.|\\n)*/"  # every text: the constrained answer is the unconstrained one
PROMPTS = [
    "List four fictional people as JSON objects with name, age, city and hobbies.",
    "Give me JSON records of four software engineers: name, age, city and a list of hobbies.",
]
MODES = {
    "plain": ({}, False),
    "plain+any": ({"grammar": ANY}, False),
    "plain+schema": ({"json_schema": PEOPLE}, False),
    "spec": ({}, True),
    "spec+any": ({"grammar": ANY}, True),
    "spec+schema": ({"json_schema": PEOPLE}, True),
}


def run(pair, prompt: str, mode: str, max_tokens: int):
    kw, speculative = MODES[mode]
    messages = [{"role": "user", "content": prompt}]
    return macspec.generate(
        pair, messages=messages, max_tokens=max_tokens, speculative=speculative, **kw
    )


def bench(pair, i: int, prompt: str, repeats: int, max_tokens: int) -> dict[str, float]:
    per: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):  # interleaved, so that the machine's load hits every mode alike
        got = {m: run(pair, prompt, m, max_tokens) for m in MODES}
        for m, r in got.items():
            s = r.stats
            per[m].append(s.tokens_per_second)
            print(
                f"prompt {i} {m:13s} {s.tokens_per_second:6.1f} tok/s  acceptance "
                f"{s.acceptance_rate:.2f}  {s.generated_tokens} tokens  {r.finish_reason}"
            )
        for base in ("plain", "spec"):
            if got[base].tokens != got[base + "+any"].tokens:
                raise SystemExit(f"prompt {i}: {base}+any differs from {base}")
    out = {}
    for m, v in per.items():
        out[m] = statistics.median(v)
        print(f"prompt {i} {m:13s} median {out[m]:.1f} [{min(v):.1f}-{max(v):.1f}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--prompts", type=int, nargs="*", help="which of the prompts (default all)")
    args = ap.parse_args()
    chosen = {i: PROMPTS[i] for i in (args.prompts or range(len(PROMPTS)))}
    pair = macspec.load(args.target, args.draft) if args.target else macspec.load()
    print(pair.describe())
    for prompt in chosen.values():  # warm-up: compiled kernels, the LLTokenizer, the policy's costs
        for m in MODES:
            run(pair, prompt, m, 16)
    meds = [bench(pair, i, p, args.repeats, args.max_tokens) for i, p in chosen.items()]
    mean = {m: statistics.mean(d[m] for d in meds) for m in MODES}
    for c in ("any", "schema"):
        for base in ("plain", "spec"):
            cost = 1 - mean[f"{base}+{c}"] / mean[base]
            print(f"{c:6s} cost against {base:5s}: {cost:+.1%}")
        free, kept = mean["spec"] / mean["plain"], mean[f"spec+{c}"] / mean[f"plain+{c}"]
        share = f"{(kept - 1) / (free - 1):.0%} kept" if free > 1 else "no speedup to keep"
        print(f"{c:6s} speedup {free:.2f}x unconstrained, {kept:.2f}x constrained: {share}")


if __name__ == "__main__":
    main()
