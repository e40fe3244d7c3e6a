"""What a constraint's masks cost per token on a real tokenizer (macspec/api/grammar.py).

Walks the tokens of a valid answer under a JSON schema (and "any JSON object"), timing the mask
of each position as a round needs it: once fresh (the draft asks), once from the cache (the
verification asks again), and the masks after k drafts computed in one go. Usage:

    python scripts/grammar_mask_cost.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from transformers import AutoTokenizer

from macspec.api.grammar import ANY_JSON_OBJECT, Grammar, Spec, json_schema_text, ll_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
}


def walk(tok, lltok, schema, text, drafts=4):
    """Seconds per mask: plain decoding (a fresh mask, then the same one from the cache), and
    rounds of `drafts` drafts (the masks after each draft prefix, fresh, all accepted)."""
    ids = tok.encode(text, add_special_tokens=False)
    spec = Spec("json_schema", json_schema_text(schema), "json_schema")
    g = Grammar(spec, lltok, len(tok))
    fresh, cached = [], []
    for t in ids:
        t0 = time.perf_counter()
        g.allowed()
        fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g.allowed()
        cached.append(time.perf_counter() - t0)
        g.commit([t])
    assert g.accepting(), "the answer should complete the schema"
    g, ahead = Grammar(spec, lltok, len(tok)), []
    for i in range(0, len(ids) - drafts, drafts + 1):
        window = ids[i : i + drafts]
        t0 = time.perf_counter()
        for j in range(drafts + 1):
            g.allowed(window[:j])
        ahead.append((time.perf_counter() - t0) / (drafts + 1))
        g.commit(ids[i : i + drafts + 1])
    return fresh, cached, ahead, len(ids)


def apply_cost(vocab: int, rows: int = 5, reps: int = 200) -> list[float]:
    """Seconds to turn `rows` masks into an MLX array and apply them to (rows, vocab) logits."""
    import mlx.core as mx
    import numpy as np

    logits = mx.random.normal((rows, vocab))
    masks = [np.random.default_rng(i).random(vocab) < 0.01 for i in range(rows)]
    mx.eval(logits)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = mx.where(mx.array(np.stack(masks)), logits, -mx.inf)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return times


def ms(xs):
    xs = sorted(x * 1e3 for x in xs)
    return f"median {statistics.median(xs):.3f} ms (p10 {xs[len(xs) // 10]:.3f}, max {xs[-1]:.3f})"


def main(paths: list[str]) -> None:
    for path in paths:
        tok = AutoTokenizer.from_pretrained(path)
        t0 = time.perf_counter()
        lltok = ll_tokenizer(tok, [tok.eos_token_id])
        build = time.perf_counter() - t0
        print(f"{path}: vocabulary {len(tok)}, llguidance tokenizer built in {build:.2f} s")
        for name, schema in (("schema", SCHEMA), ("json_object", ANY_JSON_OBJECT)):
            for text in (json.dumps(ANSWER), json.dumps(ANSWER, indent=2)):
                for _ in range(2):  # the second walk: warm caches inside llguidance
                    fresh, cached, ahead, n = walk(tok, lltok, schema, text)
                style = " (indented)" if "\n" in text else ""
                print(f"  {name:11s} {n:3d} tokens{style}")
                print(f"    fresh mask   {ms(fresh)}")
                print(f"    cached mask  {ms(cached)}")
                print(f"    4 drafts     {ms(ahead)} per mask (a round's 5 masks)")
        print(f"  a round's 5 masks applied to the logits in MLX: {ms(apply_cost(len(tok)))}")


if __name__ == "__main__":
    main(sys.argv[1:])
