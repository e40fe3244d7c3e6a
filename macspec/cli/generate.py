"""`macspec generate`: one prompt in, the answer streamed out, statistics on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..errors import OptionError


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target/--draft/--drafter, shared by the commands that load a pair."""
    p.add_argument("--target", help="target model: directory or store name (default: embedded)")
    p.add_argument("--draft", help="draft model: directory or store name")
    p.add_argument(
        "--drafter",
        choices=["model", "ngram"],
        help="'ngram': copy from the prompt and output, no draft model; "
        "'model': the draft model only (default: n-gram first, then the draft model)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The options of macspec.generate(), flag for keyword."""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per round (K)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--no-speculation", dest="speculative", action="store_false", help="plain decoding"
    )
    p.add_argument(
        "--no-adaptive", dest="adaptive", action="store_false", help="draft exactly K every round"
    )


SAMPLING_KEYS = (
    "max_tokens temperature top_p top_k min_p repetition_penalty num_draft seed stop speculative"
    " adaptive"
).split()


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in SAMPLING_KEYS if hasattr(args, k)}


def load_pair(args: argparse.Namespace):
    from .. import load
    from ..engine.distributed import init_group, serve_if_follower

    kwargs = {"drafter": args.drafter} if getattr(args, "drafter", None) else {}
    # Under mlx.launch the target is sharded; ranks > 0 serve rank 0 and exit in there.
    pair = load(args.target, args.draft, group=init_group(), **kwargs)
    serve_if_follower(pair)
    return pair


def summary(stats) -> str:
    """One line a person can read: speed against plain decoding, acceptance, round length."""
    base = 1 / stats.plain_step_time if stats.plain_step_time else 0.0
    parts = [
        f"{stats.generated_tokens} tokens in {stats.total_time:.2f}s",
        f"{stats.tokens_per_second:.1f} tok/s",
        f"plain {base:.1f} tok/s" + (f" ({stats.tokens_per_second / base:.2f}x)" if base else ""),
    ]
    if stats.drafted:
        parts += [
            f"acceptance {stats.acceptance_rate:.0%}",
            f"{stats.mean_accepted_length:.2f} tokens/round",
        ]
    return ", ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    from .. import stream_generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if prompt is None:
        raise OptionError("no prompt: give one as an argument, or '-' to read standard input")
    pair = load_pair(args)
    if args.raw_prompt:
        source = {"prompt": prompt}
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        source = {"messages": [*system, {"role": "user", "content": prompt}]}
    print(f"[macspec] {pair.describe()}", file=sys.stderr)
    stream = stream_generate(pair, **source, **sampling_kwargs(args))
    tokens, finish = [], None
    for event in stream:
        tokens += event.emitted
        finish = event.finish_reason
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    stats = stream.stats()
    if args.json:
        out = {
            "tokens": tokens,
            "text": pair.tokenizer.decode(tokens),
            "finish_reason": finish,
            "stats": dataclasses.asdict(stats),
        }
        print(json.dumps(out, indent=1))
    else:
        print()
        print(f"[macspec] {summary(stats)}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt")
    p.add_argument("prompt", nargs="?", help="the prompt, or '-' for standard input")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="system prompt (chat template only)")
    p.add_argument(
        "--raw-prompt", action="store_true", help="encode the prompt as-is, no chat template"
    )
    p.add_argument("--json", action="store_true", help="print tokens, text and statistics as JSON")
    p.set_defaults(func=run_generate)
