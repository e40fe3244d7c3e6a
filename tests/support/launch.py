"""`mlx.launch` and free loopback ports for the distributed tests (core and docs)."""

import shutil
import socket
import sys
from pathlib import Path


def mlx_launch() -> str:
    found = Path(sys.executable).parent / "mlx.launch"
    return str(found) if found.exists() else (shutil.which("mlx.launch") or "mlx.launch")


def free_port(count: int) -> int:
    """A base port with `count` free ports after it (checked, not guaranteed: good enough here)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65000 and all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
