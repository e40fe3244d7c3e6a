"""The long-context costs a load measures (core/measure.py), kept on disk for the next loads.

Measuring after a long prompt is mostly that prompt's prefill (seconds on a CPU), so the result is
kept per machine, pair, weights, backend and accelerator setup, and measured again after
KEEP_DAYS, when the measuring code changed, or when this load's plain step is more than
KEEP_SPREAD off the one measured with it (a busier or idler machine than then).
MACSPEC_KEEP_COSTS=0 measures at every load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx

from ..base import switches
from ..base.paths import costs_dir
from ..core import hooks, measure, policy
from ..core.loaded import LoadedPair
from ..core.policy import Costs

log = logging.getLogger("macspec")

KEEP_DAYS = 7
KEEP_SPREAD = 0.25  # how far this load's plain step may be from the kept one's


def calibrate(pair: LoadedPair, k: int = 4, long: int = measure.FAR) -> Costs:
    """core.measure.calibrate, with the long context's costs kept on disk (unless switched off)."""
    kept = KeptCosts(pair, k) if switches.KEEP_COSTS.value() else None
    return measure.calibrate(pair, k, long, kept)


def _stamp(path: Path | None) -> list:
    """What identifies a model directory's weights: their names, sizes and times."""
    if path is None:
        return []
    files = sorted(Path(path).glob("*.safetensors"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


class KeptCosts:
    """core.measure.Kept as one JSON file per setup under `$MACSPEC_HOME/costs`."""

    def __init__(self, pair: LoadedPair, k: int) -> None:
        self.pair, self.k = pair, k

    def path(self, length: int) -> Path:
        pair = self.pair
        setup = [
            # The measuring code and the costs' meaning: changed, measured again.
            hashlib.sha256(
                Path(measure.__file__).read_bytes() + Path(policy.__file__).read_bytes()
            ).hexdigest(),
            str(pair.target_path),
            _stamp(pair.target_path),
            str(pair.draft_path),
            _stamp(pair.draft_path),
            pair.drafter_kind,
            pair.draft_vocab,
            self.k,
            length,
            str(mx.default_device()),
            mx.__version__,
            platform.node(),
            platform.machine(),
            os.cpu_count(),
            hooks.setup(),
        ]
        key = hashlib.sha256(json.dumps(setup, default=str).encode()).hexdigest()[:16]
        return costs_dir() / f"{key}.json"

    def read(self, length: int, short: Costs) -> Costs | None:
        """The kept costs, or None: none kept, unreadable, older than KEEP_DAYS, or kept while a
        plain step cost other than now (by KEEP_SPREAD: the machine was busier, or idler)."""
        try:
            kept = json.loads(self.path(length).read_text())
            if time.time() - kept["measured"] > KEEP_DAYS * 86400:
                log.info("kept costs older than %d days, measured again", KEEP_DAYS)
                return None
            if abs(kept["short_plain_step"] / short.plain_step - 1.0) > KEEP_SPREAD:
                log.info("kept costs from a machine this busy or idle no more, measured again")
                return None
            c = kept["costs"]
            verify = tuple((int(n), float(t)) for n, t in c["verify"])
            fields = ("plain_step", "draft_step", "extra")
            return Costs(
                **{f: float(c[f]) for f in fields},
                verify=verify,
                position=c["position"],
                measured=kept["measured"],
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("kept costs unreadable, measured again: %s", e)
            return None

    def keep(self, length: int, costs: Costs, short: Costs) -> None:
        path = self.path(length)
        data = {
            "measured": costs.measured,
            "costs": asdict(replace(costs, later=None)),
            "short_plain_step": short.plain_step,  # the state of the machine it was measured in
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)  # whole or not at all
        except OSError as e:  # a read-only cache: measured again next time
            log.info("cannot keep the measured costs (%s): measured again at the next load", e)
