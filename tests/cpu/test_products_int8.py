"""Quantized products with int8 activations (csrc/cpu_qint8.cpp): numpy's numbers bit for bit,
the same bits for a row whatever the rows and threads, and exact speculation on a target that
runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import SMALL
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from support import exactness as te
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.tinymodels import make_tiny_model

import macspec
import macspec.core.verify as engine
from macspec.base import switches
from macspec.cpu import native, products
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = pytest.mark.skipif(
    ext is None or ext.int8_isa() is None,
    reason=f"int8 products unavailable: {STATE.ext_reason or 'no integer dot products here'}",
)


def _unpack(wq: mx.array, bits: int, k: int) -> np.ndarray:
    words = np.array(wq).view(np.uint32)
    per = 32 // bits
    cols = np.arange(k)
    return ((words[:, cols // per] >> ((cols % per) * bits)) & ((1 << bits) - 1)).astype(np.int64)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as the FMA instruction rounds it.

    a * b is exact in float64; s = a * b + c in float64 has the rounding error e (TwoSum, exact).
    s rounds to the float32 that s + e rounds to, except when s is exactly halfway between two
    float32s and e is not 0: then e's sign picks the side."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    up = (e > 0) & (r64 < s)
    down = (e < 0) & (r64 > s)
    halfway = np.abs(s - r64) == np.abs(np.spacing(r)).astype(np.float64) / 2
    r = np.where(halfway & up, np.nextafter(r, np.float32(np.inf)), r)
    return np.where(halfway & down, np.nextafter(r, np.float32(-np.inf)), r).astype(np.float32)


def reference(x: mx.array, wq, scales, biases, group: int, bits: int) -> np.ndarray:
    """The int8 products' rule in numpy: per group d = max|x| / 127, q = rint(x * (127 / max|x|)),
    integer sums, then group by group acc = fma(sum q w, scale * d, acc) and
    acc = fma(bias, d * sum q, acc)."""
    x = np.array(x, np.float32).reshape(-1, x.shape[-1])
    m, k = x.shape
    w = _unpack(wq, bits, k)
    s = np.array(scales.astype(mx.float32))
    b = np.array(biases.astype(mx.float32))
    groups = k // group
    xg = x.reshape(m, groups, group)
    amax = np.abs(xg).max(-1)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint((xg * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    ds = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    sums = np.einsum("mgk,ngk->mng", q, w.reshape(-1, groups, group))
    acc = np.zeros((m, w.shape[0]), np.float32)
    for g in range(groups):
        sd = (s[None, :, g] * d[:, None, g]).astype(np.float32)
        acc = fma32(sums[:, :, g].astype(np.float32), sd, acc)
        acc = fma32(np.broadcast_to(b[None, :, g], acc.shape), ds[:, None, g], acc)
    return acc


def _weights(n: int, k: int, group: int, bits: int, dtype, seed: int = 1):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    return wq, s.astype(dtype), b.astype(dtype)


def _q8(x, weights, group, bits):
    return np.array(ext.qlinear(x, *weights, group, bits, int8=True))


@pytest.fixture
def threads():
    before = ext.threads()
    yield ext.set_threads
    ext.set_threads(before)


def test_fma_reference_rounds_once():
    # a * b + c = 1 + 3 * 2^-24 - 2^-70: just below halfway between the float32s 1 + 2^-23 and
    # 1 + 2^-22. Rounded to float64 first, it is halfway, and ties to even go up.
    a = np.array([2.0**-12 * (1 + 2.0**-23)], np.float32)
    b = np.array([2.0**-12 * (1 - 2.0**-23)], np.float32)
    c = np.array([1 + 2.0**-23], np.float32)
    twice = (a.astype(np.float64) * b + c.astype(np.float64)).astype(np.float32)
    assert twice[0] == np.float32(1 + 2.0**-22)
    assert fma32(a, b, c)[0] == np.float32(1 + 2.0**-23)
    assert fma32(-a, -b, -c)[0] == np.float32(-(1 + 2.0**-23))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_int8_products_are_numpys_bit_for_bit(bits, group, dtype):
    weights = _weights(37, 384, group, bits, dtype)  # 37 rows: two blocks of 16 and a part
    x = mx.random.normal((1, 7, 384), key=mx.random.key(2)) * 3
    x = mx.concatenate([x, mx.zeros((1, 1, 384)), mx.full((1, 1, 384), -2.0)], axis=1)
    got = _q8(x, weights, group, bits)
    assert got.shape == (1, 9, 37)
    np.testing.assert_array_equal(got[0], reference(x, *weights, group, bits))
    assert not got[0, 7].any()  # a row of zeros gives zeros


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,dtype", [(32, mx.bfloat16), (64, mx.float16), (128, mx.float32)])
@pytest.mark.parametrize("count", [1, 2])
def test_every_row_is_the_same_whatever_the_rows_and_threads(threads, bits, group, dtype, count):
    # A plain step (1 row) and each row of a verification pass (2-16 rows), or of a prompt
    # chunk (more than 64 rows are kept in parts), agree bit for bit.
    threads(count)
    weights = _weights(75, 256, group, bits, dtype, seed=3)
    x = mx.random.normal((70, 256), key=mx.random.key(4))
    alone = np.stack([_q8(x[i : i + 1], weights, group, bits)[0] for i in range(70)])
    np.testing.assert_array_equal(alone[:5], reference(x[:5], *weights, group, bits))
    for rows in [*range(2, 17), 70]:
        np.testing.assert_array_equal(_q8(x[:rows], weights, group, bits), alone[:rows])


@pytest.mark.parametrize("count", [3, 5])
def test_every_chunk_runs_once_when_threads_take_each_others_parts(threads, count):
    # More threads than this CI's cores: workers start late, and the others take the chunks of
    # their parts from the back. A chunk skipped or claimed out of its part leaves rows unset.
    threads(count)
    weights = _weights(16 * 37, 4096, 64, 4, mx.bfloat16, seed=5)  # 19 chunks of 32 rows
    x = mx.random.normal((3, 4096), key=mx.random.key(6))
    want = reference(x, *weights, 64, 4)
    for _ in range(20):
        for rows in (1, 3):
            np.testing.assert_array_equal(_q8(x[:rows], weights, 64, 4), want[:rows])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("k", [384, 320])  # 320: not a multiple of 128, the transposing kernel
def test_one_row_by_4bit_g64_weights_is_numpys_and_a_pass_rows(dtype, k):
    # one row of x has a kernel of its own there (no transposes): the same bits as several rows
    weights = _weights(37, k, 64, 4, dtype, seed=5)
    x = mx.random.normal((3, k), key=mx.random.key(6)) * 2
    rows = _q8(x, weights, 64, 4)
    for i in range(3):
        alone = _q8(x[i : i + 1], weights, 64, 4)
        np.testing.assert_array_equal(alone, reference(x[i : i + 1], *weights, 64, 4))
        np.testing.assert_array_equal(alone[0], rows[i])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_row_kernels_over_several_scale_tiles_and_at_their_largest_sums(dtype):
    # 1152 columns: 18 groups, a whole tile of 16 groups' scales and a part; every third weight
    # row's nibbles all 15 against x at +-127, the largest sums the row kernels add in 16 bits
    wq, scales, biases = _weights(37, 1152, 64, 4, dtype, seed=9)
    packed = np.array(wq)
    packed[::3] = 0xFFFFFFFF
    weights = (mx.array(packed), scales, biases)
    x = mx.random.normal((4, 1152), key=mx.random.key(10)) * 2
    x = mx.concatenate([mx.full((1, 1152), 3.0), mx.full((1, 1152), -3.0), x[2:]])
    want = reference(x, *weights, 64, 4)
    for rows in range(1, 5):
        np.testing.assert_array_equal(_q8(x[:rows], weights, 64, 4), want[:rows])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("k", [384, 1152])  # 1152: 18 groups, past the kernels' 16-group tables
def test_passes_of_1_to_16_rows_by_4bit_g64_weights_are_numpys_row_by_row(threads, dtype, count, k):
    # 1-4 rows there run a kernel of their own (csrc/cpu_q4rows.cpp; on AVX2 builds
    # cpu_q4rows_avx2.cpp, 1-8 rows), 5-8 another (csrc/cpu_q4wide.cpp), 9-16 the transposing one:
    # each gives numpy's bits, its float steps group by group in order
    threads(count)
    weights = _weights(37, k, 64, 4, dtype, seed=7)  # two 16-row blocks and a part
    x = mx.random.normal((16, k), key=mx.random.key(8)) * 2
    want = reference(x, *weights, 64, 4)
    for rows in range(1, 17):
        np.testing.assert_array_equal(_q8(x[:rows], weights, 64, 4), want[:rows])


def test_a_row_with_inf_or_nan_gives_nan_as_the_float_products_do():
    weights = _weights(20, 64, 32, 4, mx.float32)
    x = mx.random.normal((3, 64), key=mx.random.key(5))
    x = mx.where(mx.array([[False], [True], [False]]) & (mx.arange(64) == 40), mx.inf, x)
    got = _q8(x, weights, 32, 4)
    assert np.isnan(got[1]).all()
    np.testing.assert_array_equal(got[[0, 2]], reference(x[[0, 2]], *weights, 32, 4))


def test_int8_products_stay_close_to_the_float_ones():
    # Each x rounded by at most 1/254 of its group's largest value (about 1/600 of a normal x's
    # size on average): a product moves by about 0.5% of its typical size, here at most 5%.
    weights = _weights(256, 1024, 64, 4, mx.bfloat16)
    x = mx.random.normal((5, 1024), key=mx.random.key(6))
    exact = np.array(ext.qlinear(x, *weights, 64, 4))
    moved = np.abs(_q8(x, weights, 64, 4) - exact)
    assert moved.max() < 0.05 * exact.std()
    assert 0 < moved.mean() < 0.01 * exact.std()


def test_the_switch_is_read_from_the_environment():
    code = "from macspec.cpu.state import STATE; print(STATE.int8_activations)"
    for value, want in (("0", "False"), ("1", "True"), ("", "True")):
        env = {**os.environ, switches.INT8_ACTIVATIONS.name: value}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.stdout.strip() == want, done.stderr[-400:]


def test_the_switch_picks_the_products(monkeypatch):
    layer = nn.QuantizedLinear(128, 48, bias=False, group_size=64, bits=4)
    calls = []
    real = ext.qlinear
    monkeypatch.setattr(ext, "qlinear", lambda *a, **kw: calls.append(kw["int8"]) or real(*a, **kw))
    x = mx.random.normal((1, 3, 128), key=mx.random.key(7))
    weights = (layer.weight, layer.scales, layer.biases)
    for on in (True, False):
        monkeypatch.setattr(STATE, "int8_activations", on)
        got = np.array(products.quantized_linear_call(layer, x))
        want = np.array(real(x, *weights, 64, 4, int8=on))
        np.testing.assert_array_equal(got, want)
    assert calls == [True, False]


# ------------------------------------------------------------ exact speculation on a 4-bit target


def _quantized_copy(src: Path, dest: Path, group: int = 32, bits: int = 4) -> Path:
    """The model at `src` quantized to MLX's affine `bits`, as `macspec convert -q` writes it."""
    model, config = load_model(src)
    nn.quantize(model, group_size=group, bits=bits)
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": group, "bits": bits}
    (dest / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dest / f.name)
    return dest


def _spy_rows(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, int8) of every quantized product the extension runs."""
    calls: list[tuple[int, bool]] = []
    real = ext.qlinear

    def spy(x, *args, **kw):
        calls.append((x.size // x.shape[-1], kw.get("int8", False)))
        return real(x, *args, **kw)

    monkeypatch.setattr(ext, "qlinear", spy)
    return calls


def q4_pair_in(root: Path, hidden: int, group: int = 32) -> macspec.Pair:
    """A 4-bit target and a 4-bit noisy copy of it as the draft, made under `root`."""
    kw = {"seed": 0, "hidden": hidden, "tie": False}
    target = make_tiny_model(root / "target", **kw)
    draft = make_tiny_model(root / "draft", perturb=0.3, **kw)
    return macspec.load(
        _quantized_copy(target, root / "tq", group=group),
        _quantized_copy(draft, root / "dq", group=group),
    )


# Groups of 64: the layers' weights repacked at load where the build takes them (test_repack.py).
@pytest.fixture(scope="module", params=[32, 64])
def q4_pair(tmp_path_factory, request):
    pair = q4_pair_in(tmp_path_factory.mktemp("q4"), hidden=64, group=request.param)
    assert _repacked(pair.target) == (request.param in (32, 64) and ext.q4_packs())
    return pair


def _repacked(model: nn.Module) -> bool:
    return any(
        isinstance(m, nn.QuantizedLinear) and products.repacked(m) for _, m in model.named_modules()
    )


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_on_a_4bit_target_equals_plain_decoding(q4_pair, monkeypatch, k):
    monkeypatch.setattr(STATE, "int8_activations", True)
    calls = _spy_rows(monkeypatch)
    for prompt in ("Once", "The cat", "abc abc"):
        plain = macspec.generate(q4_pair, prompt, max_tokens=40, temperature=0, speculative=False)
        spec = macspec.generate(
            q4_pair, prompt, max_tokens=40, temperature=0, num_draft=k, adaptive=False
        )
        assert spec.tokens == plain.tokens
        assert spec.stats.drafted > 0
    assert all(int8 for _, int8 in calls)
    assert any(rows == k + 1 for rows, _ in calls)  # verification passes ran them


@pytest.fixture(scope="module", params=[32, 64])
def q4_small_pair(tmp_path_factory, request):
    """test_exactness's small pair, both models at 4 bits (in groups of 32 or 64: repacked)."""
    root = tmp_path_factory.mktemp("q4small")
    group = request.param
    kw = {"chars": SMALL, "scale": 8.0, "vocab_rows": 9, "tie": False, "seed": 3, "hidden": group}
    target = make_tiny_model(root / "target", **kw)
    draft = make_tiny_model(root / "draft", perturb=0.2, **kw)
    pair = macspec.load(
        _quantized_copy(target, root / "tq", group=group),
        _quantized_copy(draft, root / "dq", group=group),
    )
    assert _repacked(pair.target) == (group in (32, 64) and ext.q4_packs())
    pair.eos_token_ids = frozenset()  # every sequence has the full length
    return pair


@pytest.mark.parametrize("broken", [None, te.resample_from_p])
def test_speculative_distribution_on_a_4bit_target_is_the_targets(
    q4_small_pair, monkeypatch, broken
):
    monkeypatch.setattr(STATE, "int8_activations", True)
    if broken is not None:  # the test tells a wrong acceptance rule apart on this target too
        monkeypatch.setattr(engine, "accept", broken)
    options = {"temperature": 1.0}
    expected = exact_joint(q4_small_pair, te.PROMPT, te.DEPTH, **options)
    counts = sample_prefixes(
        q4_small_pair, te.PROMPT, te.DEPTH, te.N, num_draft=2, adaptive=False, **options
    )
    p = chi_square(expected, counts)
    assert p > 1e-3 if broken is None else p < 1e-5
