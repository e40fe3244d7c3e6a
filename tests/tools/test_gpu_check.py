"""scripts/gpu_check.sh runs where there is no GPU too (on MLX's CPU backend): the script the
README's GPU figures come from is exercised as written, on the default pair, in a few tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def test_the_gpu_check_writes_row_costs_and_the_bench(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = tmp_path / "out"
    args = ["--out", str(out), "--pairs", "default", "--max-tokens", "6", "--repeats", "1"]
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "device.txt").read_text().startswith("device: Device(")
    costs = json.loads((out / "doctor-default.json").read_text())["verify_cost"]
    assert set(costs["ms"]) == {"1", "2", "3", "5", "8"}
    assert costs["ratio"]["1"] == 1.0 and all(v > 0 for v in costs["ms"].values())
    bench = json.loads((out / "bench-default" / "bench.json").read_text())
    ran = {r["method"] for r in bench["summary"]}
    assert {"mlx_lm", "macspec_plain", "macspec_adaptive"} <= ran
    assert any(s["method"] == "mlx_lm_spec" for s in bench["skipped"])  # the default draft is no LM
    assert "plain vs default vs mlx-lm" in done.stdout
