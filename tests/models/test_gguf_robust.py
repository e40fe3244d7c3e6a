"""Damaged GGUF files: each is a ConvertError naming the file, with nothing left in the store and no
large allocation; and a fuzz test of the reader over a few hundred mutated small files."""

from __future__ import annotations

import resource
import struct

import numpy as np
import pytest
from support.gguf_arch_helpers import hf_to_gguf, make_model

from macspec.base.errors import ConvertError
from macspec.models.convert import convert
from macspec.models.gguf import prepare
from macspec.models.gguf_read import dequantize
from macspec.models.gguf_tokenizer import build_tokenizer
from macspec.models.store import store_root


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("robust")
    src = make_model(root / "src", "llama", seed=9)
    hf_to_gguf(src, root / "good.gguf", "llama", qtype="Q8_0")
    return (root / "good.gguf").read_bytes()


def layout(data: bytes) -> dict:
    """Byte offsets of the header's fields, walked independently of the converter's reader."""
    pos = 24
    kv = []

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
        elif kind == 9:
            inner, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                skip_value(inner)
        else:
            pos += {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[kind]

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8 : pos + 8 + n].decode()
        kv.append((key, pos, pos + 8 + n))  # key's length field, value type field
        pos += 8 + n
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        skip_value(kind)
    tensors = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        (dims,) = struct.unpack_from("<I", data, pos + 8 + n)
        at = pos + 12 + n
        tensors.append({"dims": at, "type": at + 8 * dims, "offset": at + 8 * dims + 4})
        pos = at + 8 * dims + 12
    return {"kv": kv, "tensors": tensors, "end": pos}


def patch(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def damaged(good: bytes) -> dict[str, bytes]:
    lay = layout(good)
    last = lay["tensors"][-1]
    kv = dict((k, (length, kind)) for k, length, kind in lay["kv"])
    return {
        "truncated in the data": good[: len(good) - 1000],
        "truncated in the header": good[: lay["end"] - 40],
        "only the magic": good[:4],
        "more tensors than it holds": patch(good, 8, "<Q", len(lay["tensors"]) + 5),
        "2^40 tensors": patch(good, 8, "<Q", 1 << 40),
        "2^40 metadata keys": patch(good, 16, "<Q", 1 << 40),
        "offset past the end": patch(good, last["offset"], "<Q", len(good)),
        "unknown type id": patch(good, last["type"], "<I", 99),
        "absurd dimension": patch(good, last["dims"], "<Q", 1 << 40),
        "zero dimension": patch(good, last["dims"], "<Q", 0),
        "version 99": patch(good, 4, "<I", 99),
        "version 1": patch(good, 4, "<I", 1),
        "big-endian": patch(good, 4, "<I", 3 << 24),
        "wrong magic": b"GGUG" + good[4:],
        "2^40-byte string": patch(good, kv["general.architecture"][0], "<Q", 1 << 40),
        "unknown value type": patch(good, kv["general.architecture"][1], "<I", 77),
        "token array of 2^40": patch(good, kv["tokenizer.ggml.tokens"][1] + 8, "<Q", 1 << 40),
        "block_count 2^31": patch(good, kv["llama.block_count"][1] + 4, "<I", 1 << 31),
        "embedding_length 0": patch(good, kv["llama.embedding_length"][1] + 4, "<I", 0),
        "architecture renamed": good.replace(b"\x08\x00\x00\x00\x05" + bytes(7) + b"llama",
                                             b"\x08\x00\x00\x00\x05" + bytes(7) + b"llamb", 1),
    }  # fmt: skip


def _store_is_empty() -> bool:
    root = store_root()
    return not root.exists() or not any(root.iterdir())


def test_the_good_file_converts(good, tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    assert (convert(str(path), output="good") / "config.json").is_file()
    assert sorted(damaged(good)) == sorted(DAMAGES)
    assert all(bad != good for bad in damaged(good).values())


DAMAGES = [
    "truncated in the data", "truncated in the header", "only the magic",
    "more tensors than it holds", "2^40 tensors", "2^40 metadata keys", "offset past the end",
    "unknown type id", "absurd dimension", "zero dimension", "version 99", "version 1",
    "big-endian", "wrong magic", "2^40-byte string", "unknown value type", "token array of 2^40",
    "block_count 2^31", "embedding_length 0", "architecture renamed",
]  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_file_is_a_clear_error(good, tmp_path, damage):
    path = tmp_path / "bad.gguf"
    path.write_bytes(damaged(good)[damage])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConvertError) as e:
        convert(str(path), output="bad")
    assert str(path) in str(e.value)
    assert _store_is_empty()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 200_000, f"peak memory grew by {grown} KiB"


def _read_everything(path) -> None:
    """What a conversion reads from the file: header, config, plan, every tensor, tokenizer."""
    gf, _, spec, targets = prepare(path)
    for name in targets:
        dequantize(path, gf.tensors[name])
    build_tokenizer(gf.metadata, path, spec.family)


def _mutate(data: bytes, rng: np.random.Generator, header_end: int) -> bytes:
    b = bytearray(data)
    kind = rng.integers(5)
    if kind == 0:  # flip a few bytes of the header (metadata and tensor table)
        for at in rng.integers(8, header_end, rng.integers(1, 4)):
            b[at] ^= 1 << rng.integers(8)
    elif kind == 1:  # random bytes over a header field
        at = rng.integers(8, header_end - 8)
        b[at : at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
    elif kind == 2:  # cut the file anywhere
        del b[rng.integers(0, len(b)) :]
    elif kind == 3:  # a huge count where an 8-byte length or count may be
        at = rng.integers(8, header_end - 8)
        struct.pack_into("<Q", b, at, int(rng.integers(1 << 20, 1 << 62)))
    else:  # drop or insert a few bytes in the header: everything after shifts
        at = rng.integers(8, header_end)
        if rng.integers(2):
            del b[at : at + rng.integers(1, 9)]
        else:
            b[at:at] = rng.integers(0, 256, rng.integers(1, 9), dtype=np.uint8).tobytes()
    return bytes(b)


def test_fuzzed_files_never_escape_as_other_errors(good, tmp_path):
    """300 mutated copies: each reads cleanly or is a ConvertError; none raises anything else,
    and none makes the process allocate a lot."""
    header_end = layout(good)["end"]
    rng = np.random.default_rng(20)
    path = tmp_path / "fuzz.gguf"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"ok": 0, "refused": 0}
    for i in range(300):
        path.write_bytes(_mutate(good, rng, header_end))
        try:
            _read_everything(path)
            outcomes["ok"] += 1
        except ConvertError as e:
            assert str(path) in str(e), (i, e)
            outcomes["refused"] += 1
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 300_000, f"peak memory grew by {grown} KiB"
    assert outcomes["refused"] > 150 and outcomes["ok"] > 10, outcomes
