"""The process's peak resident memory (RSS) over a stretch of work, for `macspec bench
--prompt-lengths`' rows. On Linux the kernel's high-water mark is reset before the stretch
(writing 5 to /proc/self/clear_refs) and read after it (VmHWM); elsewhere (macOS) only the
process's peak so far can be read (getrusage), which an earlier, larger stretch may set.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

DURING = "during the row"  # the high-water mark was reset before the stretch
SO_FAR = "process peak so far"  # getrusage's: what the process ever held

_PROC = Path("/proc/self")


@dataclass(frozen=True)
class Peak:
    bytes: int
    scope: str  # DURING or SO_FAR


def reset_peak() -> bool:
    """Set the kernel's high-water mark of this process's RSS to its present RSS; False where
    there is none to reset (no /proc, or one that refuses the write)."""
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def resident() -> int | None:
    """This process's RSS now, in bytes (None where /proc cannot tell)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss(since_reset: bool) -> Peak:
    """The peak RSS since `reset_peak()` when it returned True, else the process's peak so far."""
    if since_reset and (kib := _status_kib("VmHWM")) is not None:
        return Peak(kib * 1024, DURING)
    import resource

    most = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return Peak(most if sys.platform == "darwin" else most * 1024, SO_FAR)  # macOS: bytes


def _status_kib(field: str) -> int | None:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", (_PROC / "status").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) if found else None
