"""The pair catalog and `macspec models`: what the store holds and what it can fetch.

Above the store (which names and finds models) and the converters: fetching a catalog pair means
converting its models into the store.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import OptionError
from ..platform_info import total_memory_bytes
from . import convert as converter
from . import default
from .store import is_model_dir, list_models, load_catalog, store_root, validate_name


def _fetch(spec: dict) -> Path:
    name = validate_name(spec["name"])
    if is_model_dir(store_root() / name):
        return store_root() / name
    return converter.convert(
        spec["source"],
        output=name,
        q=str(spec.get("q", "none")),
        group_size=int(spec.get("group_size", 64)),
        dtype=spec.get("dtype"),
    )


def ensure_pair(name: str) -> tuple[Path, Path | None]:
    """(target, draft) directories of a catalog pair, fetching and converting what is missing.

    "default" is the embedded default pair (no download from Hugging Face).
    """
    if name == "default":
        draft = default.default_draft()  # checked first: a broken install fails before any download
        return default.default_target(), draft
    pairs = load_catalog()
    for pair in pairs:
        if pair["name"] == name:
            target = _fetch(pair["target"])
            draft = _fetch(pair["draft"]) if pair.get("draft") else None
            return target, draft
    names = ", ".join(["default"] + [p["name"] for p in pairs])
    raise OptionError(
        f"unknown pair {name!r}; the catalog has: {names} (see `macspec models --pairs`)"
    )


# ------------------------------------------------------------- CLI


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.0f}{prefix}{unit}" if prefix == "" else f"{n:.1f}{prefix}{unit}"
        n /= 1000
    return str(n)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _default_row(root: Path) -> list[str]:
    have = any(is_model_dir(root / default.store_name(f)) for f in default.FORMATS)
    draft = default.DRAFT_DIR.name if default.DRAFT_DIR.is_dir() else "missing: reinstall"
    target = f"{default.BASE_NAME} (PyPI {default.WHEEL_REQUIREMENT})"
    return ["default", "any", target, draft, "yes" if have else "no", "Apache-2.0; no HF account"]


def models(*, pairs: bool = False, json_output: bool = False) -> int:
    """Print the store (or the pair catalog); returns an exit code."""
    if pairs:
        catalog = load_catalog()
        mem = total_memory_bytes()
        if json_output:
            print(json.dumps(catalog, indent=2))
            return 0
        rows = [["PAIR", "MEMORY", "TARGET", "DRAFT", "IN STORE", "NOTE"]]
        root = store_root()
        rows.append(_default_row(root))
        for p in catalog:
            have = [is_model_dir(root / p[k]["name"]) for k in ("target", "draft") if p.get(k)]
            fits = mem is None or mem >= p.get("min_memory_gb", 0) * 1e9
            note = p.get("note", "")
            if not fits:
                note = ("too big for this machine; " + note).rstrip("; ")
            rows.append(
                [
                    p["name"],
                    f">={p.get('min_memory_gb', '?')}GB",
                    f"{p['target']['source']} ({p['target'].get('q', 'none')})",
                    p["draft"]["source"] if p.get("draft") else "-",
                    "yes" if all(have) else ("partly" if any(have) else "no"),
                    note,
                ]
            )
        print(_table(rows))
        print("\nFetch and chat with one: macspec chat --pair NAME")
        return 0
    infos = list_models()
    if json_output:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    if not infos:
        print(
            f"No models in the store ({store_root()}).\n"
            "Add one with `macspec convert <hf-repo | dir | file.gguf>`; `macspec chat` with no "
            "model fetches the embedded default."
        )
        return 0
    rows = [["NAME", "ARCH", "PARAMS", "BITS", "SIZE", "TOKENIZER", "ACCEPTANCE", "MTP"]]
    for i in infos:
        rows.append(
            [
                i.name,
                i.architecture,
                _human(i.parameters, "") if i.parameters else "?",
                i.bits,
                _human(i.size_bytes),
                i.fingerprint,
                i.acceptance or "",
                i.mtp or "",
            ]
        )
    print(_table(rows))
    print(f"\nstore: {store_root()}  (same TOKENIZER value = a compatible target/draft pair)")
    return 0


def _run(args: argparse.Namespace) -> int:
    return models(pairs=args.pairs, json_output=args.json_output)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="list the local model store (or the pair catalog)",
        description="List converted models: name, architecture, parameters, bits, size on disk, "
        "tokenizer fingerprint (equal = compatible pair) and a draft's measured acceptance.",
    )
    p.add_argument("--pairs", action="store_true", help="show the catalog of recommended pairs")
    p.add_argument(
        "--json", dest="json_output", action="store_true", help="machine-readable output"
    )
    p.set_defaults(func=_run)
