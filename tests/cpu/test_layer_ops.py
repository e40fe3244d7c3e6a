"""Native layer primitives (csrc/cpu_layer.cpp, cpu_attention.cpp): mlx's numbers, every row
on its own. The switched layers' tests here run them one op at a time."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from support.tinymodels import chunk_logits, llama_like

from macspec.core import hooks
from macspec.cpu import kernels, native
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = [
    pytest.mark.skipif(ext is None, reason=f"native kernels unavailable: {STATE.ext_reason}"),
    pytest.mark.usefixtures("float32_kv"),  # held to mlx-lm's float32 caches
]


def _normal(shape, seed, scale=1.0):
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 5, 48), (3, 7), (1, 2, 13)])
def test_rms_norm_agrees_with_mlx(shape):
    x, w = _normal(shape, 0), _normal(shape[-1:], 1)
    want = mx.fast.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(np.array(ext.rms_norm(x, w, 1e-5)), np.array(want), atol=1e-5)
    # a strided view (every other row) reads the same rows
    if x.shape[-2] > 1:
        view = x[..., ::2, :]
        np.testing.assert_allclose(
            np.array(ext.rms_norm(view, w, 1e-5)), np.array(want[..., ::2, :]), atol=1e-5
        )


@pytest.mark.parametrize("n", [1, 8, 13, 1536])
def test_swiglu_agrees_with_mlx(n):
    g, u = _normal((1, 3, n), 2, 6.0), _normal((1, 3, n), 3)
    g = mx.concatenate([g[..., :-1], mx.full((1, 3, 1), -200.0)], axis=-1) if n > 1 else g
    got, want = np.array(ext.swiglu(g, u)), np.array(nn.silu(g) * u)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("vocab", [1, 13, 8192, 2 * 8192 + 13])  # one segment, the tail, several
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_softmax_matches_float64_row_by_row(vocab, temperature):
    x = _normal((5, vocab), 7, 20.0)
    x = mx.concatenate([x[:, :-1], mx.full((5, 1), -mx.inf)], axis=1) if vocab > 1 else x
    got = np.array(ext.softmax(x, 1.0 / temperature))
    xs = np.array(x).astype(np.float64) / temperature
    want = np.exp(xs - xs.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    big = want > 1e-30
    assert np.max(np.abs(got[big] - want[big]) / want[big]) < 1e-5
    assert np.allclose(got.sum(-1, dtype=np.float64), 1, atol=1e-6)
    if vocab > 1:
        assert (got[:, -1] == 0).all()


def test_softmax_rows_are_alike_whatever_the_rows_and_threads():
    # A plain step samples from one row, a verification from several: the same bits.
    x = _normal((6, 3 * 8192 + 5), 8, 10.0)
    before = ext.threads()
    try:
        ext.set_threads(1)
        alone = [np.array(ext.softmax(x[r : r + 1], 1.3)) for r in range(6)]
        ext.set_threads(2)
        together = np.array(ext.softmax(x, 1.3))
    finally:
        ext.set_threads(before)
    for r in range(6):
        assert np.array_equal(alone[r][0], together[r])


@pytest.mark.parametrize("vocab", [1, 13, 8192, 3 * 8192 + 5])
def test_argmax_is_mlx_first_largest_id(vocab):
    x = mx.round(_normal((6, vocab), 9, 3.0))  # many ties: the first of them
    x[4] = -mx.inf  # nothing larger than -inf: id 0, as mlx
    if vocab > 8192:
        x[5, 8192 + 7] = 100.0  # a later segment's
        x[5, 2 * 8192 + 1] = 100.0
    assert np.array_equal(np.array(ext.argmax(x)), np.array(mx.argmax(x, axis=-1)))


def test_sample_draws_each_id_as_often_as_its_probability():
    probs = mx.array([[0.1, 0.0, 0.3, 0.6, 0.0]] * 40000)
    u = mx.random.uniform(shape=(40000, 1), key=mx.random.key(3))
    counts = np.bincount(np.array(ext.sample(probs, u)), minlength=5)
    want = np.array([0.1, 0.0, 0.3, 0.6, 0.0]) * 40000
    assert counts[1] == counts[4] == 0  # never an id of probability 0
    chi2 = (((counts - want) ** 2)[[0, 2, 3]] / want[[0, 2, 3]]).sum()
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_sample_is_the_first_id_past_u_times_the_sum():
    probs = mx.zeros((4, 3 * 8192 + 5))
    probs[:, 100] = 1.0
    probs[:, 8192 + 3] = 2.0
    probs[:, 2 * 8192 + 9] = 1.0
    u = mx.array([[0.0], [0.3], [0.5], [0.9999999]])
    assert np.array(ext.sample(probs, u)).tolist() == [100, 8192 + 3, 8192 + 3, 2 * 8192 + 9]
    # the sums of a real vocabulary's rows, alone or together, on 1 or 2 threads: the same ids
    p = mx.softmax(_normal((6, 151936), 10, 3.0), axis=-1)
    u = mx.random.uniform(shape=(6, 1), key=mx.random.key(4))
    before = ext.threads()
    try:
        ext.set_threads(1)
        alone = [np.array(ext.sample(p[r : r + 1], u[r : r + 1]))[0] for r in range(6)]
        ext.set_threads(2)
        together = np.array(ext.sample(p, u))
    finally:
        ext.set_threads(before)
    assert together.tolist() == alone
    mlx = np.array(hooks.inverse_cdf_mlx(p, u))
    assert np.abs(together.astype(int) - mlx.astype(int)).max() < 200  # rounding of the sums


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [16, 12])  # full and partial rotation of 16-wide heads
def test_rope_heads_agree_with_mlx(traditional, dims):
    heads, kv_heads, d, rows, offset = 6, 2, 16, 5, 9
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0)
    table = kernels.TableRoPE(rope, size=32)
    q, k, v = (
        _normal((1, rows, heads * d), 4),
        _normal((1, rows, kv_heads * d), 5),
        _normal((1, rows, kv_heads * d), 6),
    )
    qo, ko, vo = ext.rope_heads(q, k, v, table.cos, table.sin, heads, kv_heads, offset, traditional)

    def split(x, n):
        return x.reshape(1, rows, n, d).transpose(0, 2, 1, 3)

    np.testing.assert_allclose(
        np.array(qo), np.array(rope(split(q, heads), offset=offset)), atol=1e-5
    )
    np.testing.assert_allclose(
        np.array(ko), np.array(rope(split(k, kv_heads), offset=offset)), atol=1e-5
    )
    assert np.array_equal(np.array(vo), np.array(split(v, kv_heads)))
    # explicit positions (a tree's rows by depth): each row rotated at its own position
    positions = [9, 10, 10, 11, 11]
    qp = ext.rope_heads(
        q,
        k,
        v,
        table.cos,
        table.sin,
        heads,
        kv_heads,
        0,
        traditional,
        mx.array(positions, mx.int32),
    )[0]
    for i, pos in enumerate(positions):
        want = rope(split(q, heads)[:, :, i : i + 1], offset=pos)
        np.testing.assert_allclose(np.array(qp[:, :, i : i + 1]), np.array(want), atol=1e-5)


def _attention_case(rows, context, heads=6, kv_heads=2, d=16, capacity=None):
    """Queries and a cache view as mlx-lm's KV cache hands them over (a slice of its buffer)."""
    total = context + rows
    capacity = capacity or total + 7
    q = _normal((1, heads, rows, d), 7)
    kb, vb = _normal((1, kv_heads, capacity, d), 8), _normal((1, kv_heads, capacity, d), 9)
    return q, kb[:, :, :total, :], vb[:, :, :total, :]


@pytest.mark.parametrize(
    "rows,context,d",
    [(1, 0, 16), (1, 30, 16), (5, 12, 16), (16, 3, 16), (4, 3000, 16), (1, 600, 64)]
    # heads of 64 and 128 are weighed in registers; 12 rows over 600 keys: blocks of rows
    + [(12, 600, 64), (3, 300, 128), (16, 40, 128)],
)
def test_attend_agrees_with_mlx(rows, context, d):
    q, k, v = _attention_case(rows, context, d=d)
    total, scale = context + rows, d**-0.5
    causal = mx.arange(total)[None] <= mx.arange(context, total)[:, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=causal)
    want = want.transpose(0, 2, 1, 3).reshape(1, rows, -1)
    got = ext.attend(q, k, v, scale, True)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)


def test_attend_with_a_tree_mask():
    q, k, v = _attention_case(5, 8)
    mask = np.zeros((5, 13), dtype=bool)
    mask[:, :8] = True  # the context
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]):
        mask[row, [8 + a for a in ancestors]] = True
    mask = mx.array(mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = ext.attend(q, k, v, 0.25, False, mask)
    np.testing.assert_allclose(
        np.array(got), np.array(want.transpose(0, 2, 1, 3).reshape(1, 5, -1)), atol=2e-6
    )


def test_attend_with_a_mask_over_a_long_context():
    # Keys come in pieces of 256: one row sees none of the second piece, one sees only it.
    q, k, v = _attention_case(3, 700)
    mask = np.tril(np.ones((3, 703), dtype=bool), k=700)
    mask[1, 256:512] = False
    mask[2, :256] = mask[2, 512:] = False
    mask = mx.array(mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = ext.attend(q, k, v, 0.25, False, mask)
    np.testing.assert_allclose(
        np.array(got), np.array(want.transpose(0, 2, 1, 3).reshape(1, 3, -1)), atol=2e-6
    )


@pytest.mark.parametrize("context,d", [(20, 16), (3000, 16), (700, 64)])  # (threads: 3000, 700)
def test_every_attention_row_equals_that_row_alone(context, d):
    # A verification row and the plain step that would compute it agree bit for bit.
    rows = 6
    q, k, v = _attention_case(rows, context, d=d)
    together = np.array(ext.attend(q, k, v, 0.25, True))
    for i in range(rows):
        seen = context + i + 1
        alone = ext.attend(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], 0.25, True)
        assert np.array_equal(np.array(alone)[0, 0], together[0, i])


@pytest.mark.parametrize("heads,kv_heads,d", [(5, 1, 20), (8, 2, 64), (4, 4, 12), (14, 2, 128)])
def test_query_heads_in_uneven_groups_agree_with_mlx_and_each_row_with_that_row_alone(
    heads, kv_heads, d
):
    # Query heads sharing a key head are worked on in groups (of 3 with AVX-512, else 2), the
    # keys 8 at a time and the values in blocks of vectors: here groups that do not divide the
    # heads, head sizes with lanes left over, and keys that are not a multiple of 8.
    rows, context = 7, 300
    q, k, v = _attention_case(rows, context, heads=heads, kv_heads=kv_heads, d=d)
    total, scale = context + rows, d**-0.5
    causal = mx.arange(total)[None] <= mx.arange(context, total)[:, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=causal)
    together = np.array(ext.attend(q, k, v, scale, True))
    np.testing.assert_allclose(
        together, np.array(want.transpose(0, 2, 1, 3).reshape(1, rows, -1)), atol=2e-6
    )
    for i in range(rows):
        seen = context + i + 1
        alone = ext.attend(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], scale, True)
        assert np.array_equal(np.array(alone)[0, 0], together[0, i])


@pytest.mark.parametrize("heads,d", [(7, 128), (6, 64), (5, 72), (3, 16)])
def test_each_query_head_gets_the_bits_it_gets_alone(heads, d):
    # With AVX-512 the heads of a group are scored two to a register and weighed 16 lanes at a
    # time; every head's sums are still its own, in its own order: a head attending alone (a
    # group of one, 8 lanes at a time) gives the same bits. Keys not a multiple of 8, 256.
    rows, context = 5, 530
    q, k, v = _attention_case(rows, context, heads=heads, kv_heads=1, d=d)
    scale = d**-0.5
    together = np.array(ext.attend(q, k, v, scale, True)).reshape(rows, heads, d)
    for h in range(heads):
        alone = np.array(ext.attend(q[:, h : h + 1], k, v, scale, True))[0]
        assert np.array_equal(alone, together[:, h])


def test_bad_shapes_are_refused_with_a_message():
    q, k, v = _attention_case(2, 3)
    with pytest.raises(ValueError, match="macspec attend"):
        ext.attend(q[0], k, v, 0.25, True)
    with pytest.raises(ValueError, match="boolean mask"):
        ext.attend(q, k, v, 0.25, False, mx.ones((2, 4)))
    with pytest.raises(ValueError, match="macspec rms_norm"):
        ext.rms_norm(mx.ones((2, 8)), mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="macspec swiglu"):
        ext.swiglu(mx.ones((2, 8)), mx.ones((2, 9)))
    with pytest.raises(ValueError, match="positions past the table"):
        table = kernels.TableRoPE(nn.RoPE(16), size=4)
        ext.rope_heads(
            mx.ones((1, 3, 32)),
            mx.ones((1, 3, 16)),
            mx.ones((1, 3, 16)),
            table.cos,
            table.sin,
            2,
            1,
            2,
            False,
        )


@pytest.fixture
def spy(monkeypatch, native_calls):
    """The native primitives the switched layers call, one op at a time (the fused layers,
    which run the same kernels, are tests/cpu/test_blocks.py's)."""
    monkeypatch.setattr(STATE, "native_blocks", False)
    return native_calls


@pytest.mark.parametrize("module", [llama, qwen2])
def test_switched_layers_run_the_primitives_and_give_mlx_lm_logits(module, spy):
    model = llama_like(module, model_type=module.__name__.rsplit(".", 1)[-1])
    chunks = [[3, 9, 27, 17], [5], [40, 2, 33], [60, 1] * 12]  # the last: a prompt chunk
    stock = chunk_logits(model, chunks)
    kernels.accelerate(model)
    fast = chunk_logits(model, chunks)
    for a, b in zip(stock, fast, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
    passes, layers = len(chunks), 2
    # every pass, the prompt chunk too: two norms a layer and the final one, SwiGLU, attention
    assert spy["rms_norm"] == passes * (2 * layers + 1)
    assert spy["swiglu"] == passes * layers
    assert spy["rope_heads"] == spy["attend"] == passes * layers


def test_switched_layers_over_a_long_context_give_mlx_lm_logits(spy):
    # Past 256 cached keys attention is split into pieces joined afterwards.
    model = llama_like(llama, max_position_embeddings=2048)
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 64, 700)]
    chunks = [prompt, [5], [40, 2, 33, 7, 9], [11]]
    stock = chunk_logits(model, chunks)
    kernels.accelerate(model)
    fast = chunk_logits(model, chunks)
    for a, b in zip(stock, fast, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5)
    assert spy["attend"] == 4 * 2  # the 700-id prompt too


def test_switched_off_they_run_mlx_ops(spy):
    model = llama_like(llama)
    kernels.accelerate(model)
    kernels.set_native_layers(False)
    try:
        off = chunk_logits(model, [[1, 2, 3], [4]])
    finally:
        kernels.set_native_layers(True)
    assert not spy
    on = chunk_logits(model, [[1, 2, 3], [4]])
    for a, b in zip(off, on, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5)


def test_a_tree_pass_runs_the_primitives_with_positions_and_mask(spy):
    from macspec.core import caches, tree

    model = llama_like(llama)
    kernels.accelerate(model)
    shape = tree.Tree(tokens=[20, 21, 22, 23], parents=[-1, -1, 0, 1])
    prompt = [5, 17, 30, 8]
    cache = caches.make_cache(model, 8)
    with caches.forward(cache, 3):
        model(mx.array([prompt[:-1]]), cache=cache)
    rows = [-1, *range(len(shape))]
    mask = tree.attend(shape, 3, rows, rows)
    spy.clear()
    with tree.tree_pass(model, cache, mask, [0, *shape.depths], 3):
        with caches.forward(cache, len(rows), rewindable=True):
            logits = model(mx.array([[prompt[-1], *shape.tokens]]), cache=cache)[0]
    assert spy["rope_heads"] == spy["attend"] == 2
    for i, node in enumerate(rows):
        path = prompt + ([shape.tokens[n] for n in shape.path(node)] if node >= 0 else [])
        want = chunk_logits(model, [path])[0][-1]
        np.testing.assert_allclose(np.array(logits[i]), want, atol=2e-5)
    attn = model.model.layers[0].self_attn
    assert STATE.tree(attn) is None and isinstance(STATE.rope(attn), kernels.TableRoPE)
