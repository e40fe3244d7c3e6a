"""Long prompts on a pair: the time to the first token, prefill and decode tok/s, plain and the
default at each draft context, and llama.cpp on the same GGUF and ids (with --gguf and the
optional xllamacpp package). The prompt is a pasted file, Python's own argparse, collections,
shutil and subprocess sources cut to the length, then a request to summarize it; every run
reads its prompt whole (the prompt cache emptied first). docs/benchmarks.md, "Long prompts".

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE MACSPEC_NO_BLAS_PRELOAD=1 \\
        python scripts/long_prompts.py --pair qwen2.5-coder-1.5b --lengths 512,2048,4096
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import shutil
import subprocess
import sys

import macspec
from macspec.models.catalog import ensure_pair

ASK = "\n\nSummarize what the code above does, in a few sentences.\n"


def prompt_ids(tokenizer, n: int) -> list[int]:
    source = "".join(
        pathlib.Path(m.__file__).read_text() for m in (argparse, collections, shutil, subprocess)
    )
    ask = tokenizer.encode(ASK, add_special_tokens=False)
    return tokenizer.encode(source, add_special_tokens=False)[: n - len(ask)] + ask


def macspec_rows(pair, ids: list[int], contexts: list[int], max_tokens: int) -> list[dict]:
    rows = []
    for method, context in [("plain", 0)] + [("default", c) for c in contexts]:
        pair.draft_context = context
        pair.prompt_cache.clear()  # the whole prompt is read
        r = macspec.generate(pair, ids, max_tokens=max_tokens, speculative=method != "plain")
        s = r.stats
        rows.append(
            {
                "ids": len(ids),
                "method": method if method == "plain" else f"default, draft context {context}",
                "ttft_s": round(s.prefill_time, 2),
                "prefill_tok_s": round(len(ids) / s.prefill_time, 1),
                "decode_tok_s": round(s.generated_tokens / s.total_time, 2),
                "summary": s.summary(),
            }
        )
    return rows


def llamacpp_rows(gguf: str, ids: list[int], max_tokens: int, threads: int) -> list[dict]:
    import xllamacpp as xl

    p = xl.CommonParams()
    p.model.path, p.n_ctx, p.n_parallel, p.verbosity = gguf, len(ids) + max_tokens + 64, 1, 0
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    server = xl.Server(p)
    req = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
    got: list = []
    server.handle_completions({**req, "stream": False}, got.append)
    t = got[-1]["timings"]
    return [
        {
            "ids": len(ids),
            "method": "llama.cpp plain (xllamacpp)",
            "ttft_s": round(t["prompt_ms"] / 1000, 2),
            "prefill_tok_s": round(t["prompt_per_second"], 1),
            "decode_tok_s": round(t["predicted_per_second"], 2),
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen2.5-coder-1.5b", help="a catalog pair")
    p.add_argument("--lengths", default="512,2048,4096", help="prompt ids, comma-separated")
    p.add_argument("--draft-contexts", default="0,512", help="the default's draft contexts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gguf", help="llama.cpp's rows: the target's GGUF file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", help="a JSON file for the rows")
    args = p.parse_args(argv)
    pair = macspec.load(*ensure_pair(args.pair))
    macspec.generate(pair, "def f(x):", max_tokens=8)  # one-time costs out of the first run
    contexts = [int(c) for c in args.draft_contexts.split(",")]
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = prompt_ids(pair.tokenizer, n)
        rows += macspec_rows(pair, ids, contexts, args.max_tokens)
        if args.gguf:
            rows += llamacpp_rows(args.gguf, ids, args.max_tokens, args.threads)
        for row in rows[-(len(contexts) + 1 + bool(args.gguf)) :]:
            print(json.dumps({k: v for k, v in row.items() if k != "summary"}), flush=True)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
