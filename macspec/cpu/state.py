"""The CPU accelerator's state, in one object: its switches (read once from the environment,
changed by tests and A/B timing), the classes it switched, what it keeps of each module it
switched, and the token tree whose pass is running.

What it keeps of a module (a RoPE table, whether a layer fuses, ...) lives here, keyed by the
module, not as attributes on mlx-lm's objects: the core and mlx-lm never see it, and an entry
goes when its module is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..base import switches
from ..base.errors import OptionError


@dataclass(eq=False)
class Kept:
    """What the accelerator keeps of one module it switched.

    - rope: an attention's RoPE table (kernels.TableRoPE), None where it keeps its own module;
    - fusable: a decoder layer runs as two native primitives (blocks.py);
    - overlap: a decoder layer starts evaluating the pass built so far (kernels.overlapped);
    - checked: a layer's weights as blocks.layer_weights last checked them."""

    rope: Any = None
    fusable: bool = False
    overlap: bool = False
    checked: Any = None


class State:
    """Everything the CPU package changes as it runs (one instance, STATE)."""

    def __init__(self) -> None:
        # A malformed switch read here, at import, is raised where the CPU package is first used
        # (check: a model's load, the command line), as the project's error with its message,
        # not as a traceback out of `import macspec`.
        self.switch_error: OptionError | None = None
        read = self._read
        self.native_layers = read(switches.NATIVE_LAYERS)  # kernels.py's layer primitives
        self.native_blocks = read(switches.NATIVE_BLOCKS)  # blocks.py's fused layers
        self.native_products = read(switches.NATIVE_PRODUCTS)  # products.py
        # Off: quantized products take float activations (the weights unpacked to float32)
        # instead of int8 ones with integer dot products, llama.cpp's choice on CPUs too. Int8
        # moves the logits slightly, for plain and speculative decoding alike: exactness is
        # relative to the target as run.
        self.int8_activations = read(switches.INT8_ACTIVATIONS)
        # Off: 4-bit weights stay in MLX's layout, and each pass transposes them on the fly.
        self.repack_weights = read(switches.REPACK)
        # Off: repacked weights keep float32 scales and biases even where they factor exactly.
        self.factor_scales = read(switches.FACTOR_SCALES)
        # What the accelerated layers' KV caches hold (kv_rows below): float16 halves what a
        # step reads at a long context; the attention widens it to float32 exactly.
        self.kv_dtype = mx.float16 if read(switches.KV_CACHE) == "float16" else mx.float32
        self.overlap = True  # layers start evaluations (kernels.serial turns it off)
        self.compiler_works: bool | None = None  # mx.compile works here; None: not tried yet
        self.told: set[str] = set()  # what was logged once
        # The native extension (native.py): loaded, or why not, tried once.
        self.ext: ModuleType | None = None
        self.ext_tried = False
        self.ext_reason: str | None = None  # why it is not in use, when it is not
        self.ext_build: str | None = None  # the loaded build's key (kept costs)
        self.switched: dict[type, type] = {}  # mlx's class -> the accelerator's subclass
        self.stock: dict[type, type] = {}  # the accelerator's subclass -> mlx's class
        self.masks: dict[tuple[int, int], mx.array] = {}  # kernels._causal's, by shape
        self.positions: dict[tuple, mx.array] = {}  # rows.py's, (offsets, width) -> positions
        self._kept: dict[int, Kept] = {}  # id(module) -> what is kept of it, while it lives
        # id(attention) -> (table, positions, end) during a token tree's pass (tree_positions)
        self._tree: ContextVar[dict[int, tuple] | None] = ContextVar("macspec_cpu_tree")

    def _read(self, switch: switches.Switch) -> Any:
        """The switch's value, or its default with the first malformed one's error kept."""
        try:
            return switch.value()
        except OptionError as e:
            self.switch_error = self.switch_error or e
            return switch.default

    def check(self) -> None:
        """The OptionError of a malformed switch read at import, if there was one."""
        if self.switch_error is not None:
            raise self.switch_error

    def subclass(self, cls: type, methods: dict[str, Any]) -> type:
        """`cls` with these methods replaced: the class a module of `cls` is switched to (one
        per class; named as `cls`, so that mlx-lm's names and messages stay its own)."""
        if cls not in self.switched:
            sub = type(cls.__name__, (cls,), methods)
            self.switched[cls], self.stock[sub] = sub, cls
        return self.switched[cls]

    def stock_class(self, module: Any) -> type:
        """hooks.stock_class: the class `module` had before the accelerator switched it."""
        cls = type(module)
        return self.stock.get(cls, cls)

    def is_switched(self, module: Any) -> bool:
        return type(module) in self.stock

    def kept(self, module: nn.Module) -> Kept | None:
        return self._kept.get(id(module))

    def keep(self, module: nn.Module) -> Kept:
        """What is kept of `module`, a fresh entry the first time (gone with the module)."""
        kept = self._kept.get(id(module))
        if kept is None:
            kept = self._kept[id(module)] = Kept()
            weakref.finalize(module, self._kept.pop, id(module), None)
        return kept

    def rope(self, attn: nn.Module) -> Any:
        """The attention's RoPE table; None in a token tree's pass (its module's `rope`, which
        the tree replaced, rotates the rows op by op) and where it keeps its own module."""
        kept = self._kept.get(id(attn))
        if kept is None or self.tree(attn) is not None:
            return None
        return kept.rope

    def tree(self, attn: nn.Module) -> tuple | None:
        """(table, positions, end) where `attn` runs in a token tree's pass; else None."""
        trees = self._tree.get(None)
        return None if trees is None else trees.get(id(attn))

    @contextmanager
    def tree_positions(self, modules: list, positions: mx.array, end: int) -> Iterator[None]:
        """hooks.tree_positions: a token tree's pass (core/tree.py) for these attention
        modules, the switched ones with a table rotating row r at positions[r] (up to `end`)."""
        trees = {}
        for m in modules:
            kept = self._kept.get(id(m))
            if kept is not None and kept.rope is not None:
                trees[id(m)] = (kept.rope, positions, end)
        token = self._tree.set(trees)
        try:
            yield
        finally:
            self._tree.reset(token)


STATE = State()


def kv_rows(k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
    """New keys and values as the accelerated layers' caches hold them (STATE.kv_dtype), with a
    cache or without: every pass, plain or verifying, reads the same stored values, so rows
    still agree bit for bit. The native primitives give them so themselves (their `half`
    argument, rounded as here); only float32 ones are narrowed: a half model's stay as they are."""
    if k.dtype != mx.float32 or STATE.kv_dtype == mx.float32:
        return k, v
    return k.astype(STATE.kv_dtype), v.astype(STATE.kv_dtype)
