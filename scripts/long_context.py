"""Decoding speed after a long prompt: plain and speculative tokens/s (prefill excluded) of a
pair at several context lengths, as llama.cpp's `llama-bench -d N` measures depth.

    python scripts/long_context.py [--target NAME --draft NAME] [--contexts 150,1000,2000]
        [--max-tokens 64] [--repeats 2]

The prompt is the built-in training prompts as a numbered list, cut to length, and a question
about them: varied text, so drafts cannot simply copy a repeated passage. Best of `--repeats`.
"""

from __future__ import annotations

import argparse

import macspec
from macspec.api import prompt_ids
from macspec.tools.distill.train_prompts import TRAIN_PROMPTS

QUESTION = "Answer the first three questions above, one short paragraph each."


def messages_of(pair: macspec.Pair, tokens: int) -> list[dict[str, str]]:
    """A user message of about `tokens` tokens (the chat template included)."""
    questions = [t for kind in TRAIN_PROMPTS.values() for t in kind]
    lines: list[str] = []
    for i, q in enumerate(questions):
        lines.append(f"{i + 1}. {q}")
        text = "Questions people asked:\n" + "\n".join(lines) + "\n\n" + QUESTION
        if len(prompt_ids(pair, messages=[{"role": "user", "content": text}])) >= tokens:
            break
    return [{"role": "user", "content": text}]


def decode_rate(pair: macspec.Pair, messages: list, speculative: bool, max_tokens: int) -> tuple:
    r = macspec.generate(
        pair, messages=messages, max_tokens=max_tokens, speculative=speculative, temperature=0
    )
    s = r.stats
    return s.generated_tokens / (s.total_time - s.prefill_time), s.prompt_tokens, s.generated_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--contexts", default="150,1000,2000")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    pair = macspec.load(args.target, args.draft)
    print(pair.describe())
    print("| context | plain tok/s | speculative tok/s | ratio | tokens |\n|---|---|---|---|---|")
    for n in (int(c) for c in args.contexts.split(",")):
        messages = messages_of(pair, n)
        best = {}
        for spec in (False, True):
            runs = [decode_rate(pair, messages, spec, args.max_tokens) for _ in range(args.repeats)]
            best[spec], context, made = max(r[0] for r in runs), runs[0][1], runs[0][2]
        ratio = best[True] / best[False]
        row = f"| {context} | {best[False]:.1f} | {best[True]:.1f} | {ratio:.2f}x | {made} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
