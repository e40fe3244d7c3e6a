"""Structured output's cost: tok/s of unconstrained and constrained generation, plain and
speculative, on the same prompts in one run (macspec.generate, greedy).

    python scripts/bench_structured.py [--target DIR --draft DIR] [--repeats 3] [--max-tokens 160]
        [--prompts 0 1]

Two constraints: "any", a grammar every text satisfies, so the constrained answer is token for
token the unconstrained one (checked) and acceptance is equal: what the masks themselves cost;
and "schema", a JSON schema of a list of four people (its answer differs, acceptance is shown).
One line per run, then per prompt the median tok/s over repeats and its range, then paired
ratios (median and range over repeats): each constraint against unconstrained decoding, and
speculation's speedup with and without it.
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


def bench(pair, i: int, prompt: str, repeats: int, max_tokens: int) -> dict[str, list[float]]:
    """tok/s of every mode, `repeats` times; each repeat runs the modes in a rotated order, so
    that a drift in the machine's load does not always favour the same mode."""
    per: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        got = {m: run(pair, prompt, m, max_tokens) for m in order}
        for m in names:
            s = got[m].stats
            per[m].append(s.tokens_per_second)
            print(
                f"prompt {i} {m:13s} {s.tokens_per_second:6.1f} tok/s  acceptance "
                f"{s.acceptance_rate:.2f}  {s.generated_tokens} tokens  {got[m].finish_reason}"
            )
        for base in ("plain", "spec"):
            if got[base].tokens != got[base + "+any"].tokens:
                raise SystemExit(f"prompt {i}: {base}+any differs from {base}")
    for m, v in per.items():
        print(f"prompt {i} {m:13s} median {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]")
    return per


def ratio(a: list[float], b: list[float]) -> str:
    """Median and range of a/b over repeats (paired: each repeat's runs are minutes apart)."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    return f"{statistics.median(r):.3f} [{min(r):.3f}-{max(r):.3f}]"


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
    runs = {m: [] for m in MODES}
    for i, p in chosen.items():
        for m, v in bench(pair, i, p, args.repeats, args.max_tokens).items():
            runs[m] += v
    for c in ("any", "schema"):
        for base in ("plain", "spec"):
            print(f"{base}+{c} / {base}: {ratio(runs[f'{base}+{c}'], runs[base])}")
        print(f"speedup unconstrained (spec / plain): {ratio(runs['spec'], runs['plain'])}")
        print(
            f"speedup under {c} (spec+{c} / plain+{c}): "
            f"{ratio(runs[f'spec+{c}'], runs[f'plain+{c}'])}"
        )


if __name__ == "__main__":
    main()
