"""The restructure's reference run: every drafter, tree and batch path on the test pairs, token for
token, written before a change and compared after it (issue 53's "same tokens before and after").

    python scripts/reference_tokens.py --save before.json     # on the code before the change
    python scripts/reference_tokens.py --compare before.json  # after: exit 1 on any difference

Greedy runs may adapt K (their tokens never depend on it); seeded runs at T > 0 fix K, because
the random keys a generation splits depend on the rounds it runs. The tiny models are built from
seeds by the tests' own builders (tests/support), so both runs use the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import macspec  # noqa: E402  (after the path: the tests' builders import it too)
from macspec.core.batch_rounds import BatchDriver  # noqa: E402

PROMPTS = [
    "the cat sat on the mat",
    "a b c a b c a b c a b",
    "once upon a time there was a little dog who ran and ran",
]
SAMPLING = [
    {"temperature": 0.0},
    {"temperature": 0.0, "adaptive": False, "num_draft": 5},
    {"temperature": 0.8, "seed": 7, "adaptive": False, "num_draft": 3},
    {"temperature": 1.0, "seed": 3, "adaptive": False, "top_p": 0.9, "repetition_penalty": 1.2},
]
TREES = [
    {"temperature": 0.0, "tree_nodes": 6},
    {"temperature": 0.8, "seed": 5, "adaptive": False, "num_draft": 3, "tree_nodes": 6},
]


def pairs(root: Path) -> dict[str, macspec.Pair]:
    from support.drafter_models import make_eagle3_draft, make_eagle_target
    from support.drafts import make_draft
    from support.tinymodels import make_tiny_model

    target = make_tiny_model(root / "target", seed=0, hidden=48, tie=False)
    noisy = make_tiny_model(root / "draft", seed=0, hidden=48, tie=False, perturb=0.3)
    out = {
        "hybrid": macspec.load(target, noisy),
        "model": macspec.load(target, noisy, drafter="model"),
        "ngram": macspec.load(target, drafter="ngram"),
    }
    eagle_target = make_tiny_model(root / "et", seed=0, hidden=48, tie=False, scale=2.0)
    out["eagle"] = macspec.load(eagle_target, make_draft(root / "ed", eagle_target))
    e3_target = make_eagle_target(root / "e3t")
    out["eagle3"] = macspec.load(e3_target, make_eagle3_draft(root / "e3d", e3_target, "eagle"))
    for p in out.values():
        p.eos_token_ids = frozenset()  # full-length answers: more rounds
    return out


def alone(pairs_: dict[str, macspec.Pair]) -> dict[str, list[int]]:
    out = {}
    for name, pair in pairs_.items():
        for i, opts in enumerate(SAMPLING + (TREES if name in ("hybrid", "model") else [])):
            for j, prompt in enumerate(PROMPTS):
                got = macspec.generate(pair, prompt, max_tokens=40, **opts)
                out[f"{name}/opts{i}/prompt{j}"] = got.tokens
        events = macspec.stream_generate(pair, PROMPTS[0], max_tokens=12, top_logprobs=2)
        lps = [x for e in events for x in e.logprobs or ()]
        out[f"{name}/logprobs"] = [[x.id, round(x.logprob, 4)] for x in lps]
    return out


def batched(pair: macspec.Pair) -> dict[str, list[int]]:
    """Three rows (draft model, n-gram, plain) sharing passes from the first round."""
    from support.batching import run_batch, variants

    kinds = variants(pair)
    out = {}
    for t, opts in enumerate(SAMPLING[1:3]):
        driver = BatchDriver(pair.target, pair.vocab_size)
        requests = [
            (kinds[kind], prompt, {"max_tokens": 30, **opts})
            for kind, prompt in zip(("model", "ngram", "plain"), PROMPTS, strict=True)
        ]
        answers, _ = run_batch(driver, requests)
        for i, ids in enumerate(answers):
            out[f"batch/opts{t}/row{i}"] = ids
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = pairs(Path(tmp))
        got = {**alone(loaded), **batched(loaded["hybrid"])}
    if args.save:
        args.save.write_text(json.dumps(got, indent=0))
        print(f"{len(got)} runs written to {args.save}")
    if args.compare:
        want = json.loads(args.compare.read_text())
        bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        for k in bad:
            print(f"differs: {k}\n  before {want.get(k)}\n  after  {got.get(k)}")
        print(f"{len(want) - len(bad)} of {len(want)} runs the same")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
