"""The fused layers' scratch (csrc/common.h, Room): a prompt chunk whose intermediate rows pass
32 MiB reuses the room of the chunk before it, instead of glibc mapping fresh pages that the
kernel zeroes at every layer (a 512-row chunk of the 1.5B target: ~8,900 page faults a layer),
and a reused room's old contents never reach an output."""

from __future__ import annotations

import resource

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen2
from support.tinymodels import chunk_logits, llama_like

from macspec.cpu import kernels, native
from macspec.cpu.state import STATE

ext = native.load()
pytestmark = pytest.mark.skipif(
    ext is None, reason=f"native kernels unavailable: {STATE.ext_reason}"
)

# 512 rows x (3 x 256 + 3 x 8,192) floats: 52 MB of MLP rows a layer, past glibc's 32 MiB
SHAPE = {"hidden_size": 256, "intermediate_size": 8192, "num_attention_heads": 4}
ROWS = 512


def _model():
    model = llama_like(qwen2, model_type="qwen2", **SHAPE)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    kernels.accelerate(model)
    return model


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_wide_chunk_reuses_its_room(native_calls):
    model = _model()
    ids = [(7 * i) % 64 for i in range(ROWS)]
    first = chunk_logits(model, [ids])[0]  # takes the rooms
    assert native_calls["attn_mlp"] == 2  # the fused layers ran
    before = _faults()
    again = chunk_logits(model, [ids])[0]
    faults = _faults() - before
    # Mapped afresh, each layer's 52 MB would fault ~12,700 pages; kept, next to none are new
    # (the logits and MLX's own buffers come from its cache).
    assert faults < 2_000, faults
    np.testing.assert_array_equal(again, first)


def test_a_reused_rooms_old_rows_never_reach_the_output(native_calls):
    model = _model()
    wide = [(5 * i + 1) % 64 for i in range(ROWS)]
    narrow = [3, 9, 27, 17, 5, 40, 2, 11]
    alone = chunk_logits(model, [narrow, [6], [7, 8]])  # before any wide chunk of this model
    chunk_logits(model, [wide])  # leaves its rows in the rooms
    after = chunk_logits(model, [narrow, [6], [7, 8]])
    for a, b in zip(alone, after, strict=True):
        np.testing.assert_array_equal(b, a)
    with kernels.stock(model):  # mlx-lm's own layers on the same weights
        stock = chunk_logits(model, [narrow, [6], [7, 8]])
    for a, b in zip(stock, after, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=5e-2)
