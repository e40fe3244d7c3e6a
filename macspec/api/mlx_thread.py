"""The one thread that runs a front end's MLX work (the chat app's generations, the server's
rounds), and the discipline that lets the process exit cleanly after it."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class MlxThread:
    """The one thread that runs the app's MLX work, kept for the app's lifetime.

    MLX keeps per-thread state whose destructors take the GIL (the compile cache, the random key).
    A thread that ends while Python shuts down then aborts the process ("terminate called without
    an active exception"), so `close` frees that state on this thread (mx.clear_streams, with the
    GIL held) and joins it before the app returns."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._stream: Any = None  # an MLX stream made on (and valid in) this thread

    def run(self, fn: Any, *args: Any) -> asyncio.Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="macspec-generate")
        return asyncio.get_running_loop().run_in_executor(self._executor, self._on_stream, fn, args)

    def _on_stream(self, fn: Any, args: tuple) -> Any:
        # MLX streams are thread-local on Metal (MLX >= 0.31.2): this thread computes on its own,
        # as mlx-lm's generation thread does.
        import mlx.core as mx

        if self._stream is None:
            self._stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(self._stream):
            return fn(*args)

    def close(self) -> None:
        """Wait for the running job (callers set its stop flag first), free MLX's state, join."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.submit(_release_thread_state)
            executor.shutdown(wait=True)


def _release_thread_state() -> None:
    import mlx.core as mx

    mx.clear_streams()  # frees this thread's MLX state (mlx >= 0.31.2, as pyproject requires)
