"""The sampling work of one pass over V ids, mlx ops against the native primitives (cpu_layer.cpp):
python scripts/sampling_cost.py [V]   (medians of 200, ms; V defaults to Qwen2.5's 151,936)"""

import sys
import time

import mlx.core as mx

import macspec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from macspec import cpu
from macspec.core import sampling, verify
from macspec.core.sampling import SamplingOptions
from macspec.cpu import kernels

HOT, GREEDY = SamplingOptions(temperature=0.7), SamplingOptions()


def median_ms(fn, n: int = 200) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def costs(x: mx.array, q: mx.array, drafts: mx.array, key: mx.array) -> tuple[float, ...]:
    """(T=0.7 distribution, one draw, accept, T=0 argmax) of the rows of x, in ms."""
    p = sampling.distribution(x, HOT)
    mx.eval(p)
    return (
        median_ms(lambda: sampling.distribution(x, HOT)),
        median_ms(lambda: sampling.sample(p[:1], key)),
        median_ms(lambda: mx.stack(list(verify.accept(p, q, drafts, key)))) if drafts.size else 0,
        median_ms(lambda: sampling.greedy_ids(x, GREEDY)),
    )


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 151936
    cpu.install()  # the CPU hooks in the core, as loading a model installs them
    key = mx.random.key(1)
    for rows in (1, 5):
        x = mx.random.normal((rows, vocab)) * 3
        q = sampling.distribution(x[: max(rows - 1, 1)] * 1.1, HOT)
        drafts = mx.arange(rows - 1) + 1
        mx.eval(x, q)
        kernels.set_native_layers(False)
        before = costs(x, q, drafts, key)
        kernels.set_native_layers(True)
        after = costs(x, q, drafts, key)
        a, b = before, after
        print(
            f"{rows} rows of {vocab}: T=0.7 distribution {a[0]:.2f} -> {b[0]:.2f} ms, "
            f"one draw {a[1]:.2f} -> {b[1]:.2f}, accept {a[2]:.2f} -> {b[2]:.2f}; "
            f"T=0 argmax {a[3]:.2f} -> {b[3]:.2f}"
        )


if __name__ == "__main__":
    main()
