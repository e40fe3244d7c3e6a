"""Every runtime switch: the `MACSPEC_*` environment variables, each defined, read and parsed here
alone, and listed by `macspec doctor`.

One rule for on/off switches: `1`, `true`, `yes` or `on` switch on; `0`, `false`, `no` or `off`
switch off (any case); unset or empty leaves the default. Any other value is an OptionError that
names the variable, as a malformed number or choice is.

Most switches are read where they act, each time (a program or a test that changes the
environment gets the new value). The CPU package's three layer switches are read once, when
macspec is imported: they are asked on every weight product.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import OptionError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One environment variable: its kind (flag, count, size, seconds, mib, path or choice), its
    default (None: unset means "not set", as the meaning says), and what it does."""

    name: str
    kind: str
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()
    at_import: bool = False

    def __str__(self) -> str:
        return self.name

    def parse(self, raw: str | None) -> Any:
        """The value `raw` (the variable's text, None when unset) stands for."""
        text = (raw or "").strip()
        if not text:
            return self.default
        if self.kind == "flag":
            if text.lower() in ON:
                return True
            if text.lower() in OFF:
                return False
            raise self._bad(raw, f"one of {'/'.join(ON)} or {'/'.join(OFF)}")
        if self.kind == "path":
            return Path(text).expanduser()
        if self.kind == "choice":
            if text not in self.choices:
                raise self._bad(raw, f"one of {', '.join(self.choices)}")
            return text
        return self._number(raw, text)

    def _number(self, raw: str, text: str) -> int | float:
        try:
            value = int(text) if self.kind in ("count", "size") else float(text)
        except ValueError:
            value = None
        if self.kind == "size" and (value is None or value < 0):
            raise self._bad(raw, "a whole number >= 0")
        if self.kind == "count" and (value is None or value < 1):
            raise self._bad(raw, "a whole number >= 1")
        if self.kind == "seconds" and (value is None or not 0 < value < float("inf")):
            raise self._bad(raw, "a number of seconds > 0")
        if value is None or not 0 <= value < float("inf"):
            raise self._bad(raw, "a number >= 0")
        return value

    def _bad(self, raw: str | None, rule: str) -> OptionError:
        return OptionError(f"{self.name}={raw!r}: must be {rule}")

    def value(self, env: Mapping[str, str] | None = None) -> Any:
        """The switch as `env` (default: this process's environment) sets it now."""
        return self.parse((os.environ if env is None else env).get(self.name))

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return bool(((os.environ if env is None else env).get(self.name) or "").strip())


HOME = Switch(
    "MACSPEC_HOME",
    "path",
    None,
    "where the model store, the CPU kernels built here and kept costs live "
    "(unset: <the platform's cache directory>/macspec)",
)
DEFAULT_FORMAT = Switch(
    "MACSPEC_DEFAULT_FORMAT",
    "choice",
    None,
    "the default model's weight format (unset: the fastest for this backend)",
    choices=("float32", "float16", "4bit"),
)
PROMPT_CACHE_MB = Switch(
    "MACSPEC_PROMPT_CACHE_MB",
    "mib",
    None,
    "MiB of model states each loaded pair keeps between prompts (unset: 1024; 0: none)",
)
KEEP_COSTS = Switch(
    "MACSPEC_KEEP_COSTS",
    "flag",
    True,
    "keep the long-context costs measured at load on disk for 7 days (off: measure every load)",
)
NO_BLAS_PRELOAD = Switch(
    "MACSPEC_NO_BLAS_PRELOAD",
    "flag",
    False,
    "do not load OpenBLAS before mlx at `import macspec` (Linux)",
)
KERNELS = Switch(
    "MACSPEC_KERNELS",
    "flag",
    True,
    "macspec's CPU layer kernels in loaded models (off: mlx-lm's own layers)",
)
SPECULATE_UNALIKE = Switch(
    "MACSPEC_SPECULATE_UNALIKE",
    "flag",
    True,
    "speculate on a target whose verification rows this backend computes to float rounding of a "
    "plain step, not bit for bit (greedy output may then differ from plain decoding at "
    "near-ties; docs/architecture.md lists them); off: such a target decodes plainly",
)
NATIVE = Switch(
    "MACSPEC_NATIVE",
    "flag",
    True,
    "build and use the native CPU extension (off: mlx's own ops for everything below)",
)
NATIVE_ARCH = Switch(
    "MACSPEC_NATIVE_ARCH",
    "choice",
    "native",
    "the instruction set the native CPU extension is built for (x86-64-v3: AVX2 and FMA, as "
    "many AMD EPYC; x86-64-v3-vnni: that and AVX-VNNI, as Intel client cores; x86-64-v4: "
    "AVX-512 without VNNI; native: this CPU's own)",
    choices=("native", "x86-64-v3", "x86-64-v3-vnni", "x86-64-v4"),
)
NATIVE_THREADS = Switch(
    "MACSPEC_NATIVE_THREADS",
    "count",
    None,
    "threads of the native CPU extension (unset: every core this process may use)",
)
NATIVE_PRODUCTS = Switch(
    "MACSPEC_NATIVE_PRODUCTS",
    "flag",
    True,
    "native weight products (off: mlx's BLAS and quantized products)",
    at_import=True,
)
INT8_ACTIVATIONS = Switch(
    "MACSPEC_INT8_ACTIVATIONS",
    "flag",
    True,
    "quantized native products take int8 activations and integer dot products (off: float ones)",
    at_import=True,
)
REPACK = Switch(
    "MACSPEC_REPACK",
    "flag",
    True,
    "4-bit weights repacked at load for the int8 products (AVX-512, AVX2; off: MLX's layout)",
    at_import=True,
)
FACTOR_SCALES = Switch(
    "MACSPEC_FACTOR_SCALES",
    "flag",
    True,
    "repacked weights' float32 scales and biases kept as a float per 8 groups times int8 where "
    "that is exact (a GGUF's K-quants; off: float32 each)",
    at_import=True,
)
KV_CACHE = Switch(
    "MACSPEC_KV_CACHE",
    "choice",
    "float16",
    "what the CPU layers' KV caches hold: float16 (llama.cpp's default; half the bytes every "
    "decoding step reads at a long context) or float32",
    choices=("float16", "float32"),
    at_import=True,
)
NATIVE_LAYERS = Switch(
    "MACSPEC_NATIVE_LAYERS",
    "flag",
    True,
    "native RMS norm, SwiGLU, RoPE and attention (off: the same as mlx ops)",
    at_import=True,
)
NATIVE_BLOCKS = Switch(
    "MACSPEC_NATIVE_BLOCKS",
    "flag",
    True,
    "a llama/qwen2 layer as two fused native primitives (off: one primitive a part)",
    at_import=True,
)
DIST_TIMEOUT = Switch(
    "MACSPEC_DIST_TIMEOUT",
    "seconds",
    None,
    "seconds rank 0 waits for the other ranks in one round before it stops (unset: 120)",
)
DRAFT_VOCAB = Switch(
    "MACSPEC_DRAFT_VOCAB",
    "size",
    None,
    "how many of the most frequent ids a draft model's head scores; the others come from the "
    "target alone (unset: core/drafters/pruned.py's default for a big vocabulary; 0: every id)",
)
DRAFT_BITS = Switch(
    "MACSPEC_DRAFT_BITS",
    "choice",
    "8",
    "bits of a published EAGLE-3 draft's weights as it runs: 8 or 4 (mlx's affine groups of 64, "
    "32 for narrow layers), or float (as stored); the draft only proposes, so any is exact",
    choices=("8", "4", "float"),
)
COMM_TIMING = Switch(
    "MACSPEC_COMM_TIMING",
    "flag",
    False,
    "time the all-reduces inside a sharded target's passes too (one sync per layer)",
)

ALL = (
    HOME,
    DEFAULT_FORMAT,
    PROMPT_CACHE_MB,
    KEEP_COSTS,
    NO_BLAS_PRELOAD,
    KERNELS,
    NATIVE,
    NATIVE_ARCH,
    NATIVE_THREADS,
    NATIVE_PRODUCTS,
    INT8_ACTIVATIONS,
    REPACK,
    FACTOR_SCALES,
    KV_CACHE,
    NATIVE_LAYERS,
    NATIVE_BLOCKS,
    DIST_TIMEOUT,
    COMM_TIMING,
    DRAFT_VOCAB,
    DRAFT_BITS,
    SPECULATE_UNALIKE,
)


@dataclass(frozen=True)
class Setting:
    """A switch as the environment sets it: its text, and its value or why it is refused."""

    switch: Switch
    raw: str | None
    value: Any
    error: str | None = None

    def describe(self) -> str:
        if self.error:
            return f"refused: {self.error}"
        shown = "(default)" if self.raw is None or not self.raw.strip() else repr(self.raw)
        return f"{shown} -> {self.value}"


def settings(env: Mapping[str, str] | None = None) -> list[Setting]:
    """Every switch with its value in `env` (default: this process's environment)."""
    env = os.environ if env is None else env
    out = []
    for s in ALL:
        raw = env.get(s.name)
        try:
            out.append(Setting(s, raw, s.parse(raw)))
        except OptionError as e:
            out.append(Setting(s, raw, None, str(e)))
    return out


def unknown(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """MACSPEC_* variables set here that no switch reads (a misspelt name does nothing), with
    their values."""
    env = os.environ if env is None else env
    known = {s.name for s in ALL}
    return {k: env[k] for k in sorted(env) if k.startswith("MACSPEC_") and k not in known}
