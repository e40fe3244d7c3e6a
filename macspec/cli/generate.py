"""`macspec generate`: one prompt in, the answer streamed out, statistics on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..base.errors import OptionError
from .common import add_pair_args, announce, generation_options, load_pair, reading_line


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
    print(announce(pair), file=sys.stderr)
    told = reading_line(sys.stderr)
    stream = stream_generate(pair, **source, on_prefill=told, **generation_options(args))
    tokens, text, finish = [], [], None
    for event in stream:
        tokens += event.emitted
        text.append(event.text)
        finish = event.finish_reason
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    stats = stream.stats()
    if args.json:
        out = {
            "tokens": tokens,
            "text": "".join(text),
            "finish_reason": finish,
            "stats": dataclasses.asdict(stats),
        }
        print(json.dumps(out, indent=1))
    else:
        print()
        print(f"[macspec] {stats.summary()}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate an answer to one prompt")
    p.add_argument("prompt", nargs="?", help="the prompt, or '-' for standard input")
    add_pair_args(p)
    p.add_argument("--system", help="system prompt (chat template only)")
    p.add_argument(
        "--raw-prompt", action="store_true", help="encode the prompt as-is, no chat template"
    )
    p.add_argument("--json", action="store_true", help="print tokens, text and statistics as JSON")
    p.set_defaults(func=run_generate)
