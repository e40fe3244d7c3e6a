"""KL(llama.cpp || macspec) on the same ids, teacher-forced, as docs/models.md reports it.

llama.cpp runs from llama-cpp-python (built from source for the CPU; it need not share macspec's
environment), so the work is three steps, each writing into OUT:

    python scripts/llamacpp_kl.py ids OUT --model NAME TEXT...   # macspec's ids of each text
    LLAMA_PY scripts/llamacpp_kl.py llama OUT --gguf FILE.gguf     # llama.cpp's log-probs
    python scripts/llamacpp_kl.py compare OUT NAME...              # KL of each store model

Windows of --context ids (a fresh context each), the first --skip of each unscored, as
`macspec eval` scores them (macspec/models/fidelity.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def windows(ids: list[int], context: int, skip: int) -> list[list[int]]:
    out = [ids[i : i + context] for i in range(0, len(ids), context)]
    return [w for w in out if len(w) > skip + 1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def ids_step(args: argparse.Namespace) -> None:
    from macspec.models.fidelity import load_model
    from macspec.models.store import resolve_model

    _, tokenizer = load_model(resolve_model(args.model))
    ids = {Path(t).name: tokenizer.encode(Path(t).read_text())[: args.max_ids] for t in args.texts}
    meta = {"ids": ids, "context": args.context, "skip": args.skip}
    (args.out / "ids.json").write_text(json.dumps(meta))


def llama_step(args: argparse.Namespace) -> None:
    from llama_cpp import Llama

    meta = json.loads((args.out / "ids.json").read_text())
    context, skip = meta["context"], meta["skip"]
    llm = Llama(
        str(args.gguf), n_ctx=context, n_batch=context, n_threads=args.threads,
        logits_all=True, verbose=False,
    )  # fmt: skip
    got = {}
    for name, ids in meta["ids"].items():
        for j, w in enumerate(windows(ids, context, skip)):
            llm.reset()
            start = time.perf_counter()
            llm.eval(w)
            scores = np.array(llm.scores[: len(w)])
            got[f"{name}:{j}"] = log_softmax(scores)[skip:-1].astype(np.float32)
            print(f"{name} window {j}: {len(w)} ids, {time.perf_counter() - start:.1f} s")
    np.savez(args.out / "llamacpp.npz", **got)


def compare_step(args: argparse.Namespace) -> None:
    from macspec.models.fidelity import _log_probs, load_model
    from macspec.models.store import resolve_model

    meta = json.loads((args.out / "ids.json").read_text())
    context, skip = meta["context"], meta["skip"]
    ref = np.load(args.out / "llamacpp.npz")
    report = {}
    for model_name in args.models:
        model, _ = load_model(resolve_model(model_name))
        for name, ids in meta["ids"].items():
            kl, top = [], []
            for j, w in enumerate(windows(ids, context, skip)):
                lp = np.array(_log_probs(model, w)[skip:-1]).astype(np.float64)
                rp = ref[f"{name}:{j}"].astype(np.float64)
                kl.append((np.exp(rp) * (rp - lp)).sum(-1))
                top.append(rp.argmax(-1) == lp.argmax(-1))
            kl, top = np.maximum(np.concatenate(kl), 0.0), np.concatenate(top)
            row = {
                "positions": len(kl),
                "kl_mean": float(kl.mean()),
                "kl_median": float(np.median(kl)),
                "kl_p99": float(np.percentile(kl, 99)),
                "top1_agreement": float(top.mean()),
            }
            report[f"{model_name} {name}"] = row
            print(model_name, name, {k: round(v, 5) for k, v in row.items()})
        del model
    (args.out / "compare.json").write_text(json.dumps(report, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("ids")
    a.add_argument("out", type=Path)
    a.add_argument("--model", required=True, help="the store model whose tokenizer encodes")
    a.add_argument("texts", nargs="+")
    a.add_argument("--context", type=int, default=512)
    a.add_argument("--skip", type=int, default=4)
    a.add_argument("--max-ids", type=int, default=1024)
    b = sub.add_parser("llama")
    b.add_argument("out", type=Path)
    b.add_argument("--gguf", type=Path, required=True)
    b.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("out", type=Path)
    c.add_argument("models", nargs="+")
    args = p.parse_args()
    if args.step == "ids":
        args.out.mkdir(parents=True, exist_ok=True)
    {"ids": ids_step, "llama": llama_step, "compare": compare_step}[args.step](args)


if __name__ == "__main__":
    main()
