"""A sharded target over 2 and 3 local processes (ring backend over loopback), tiny models.

Each launch runs tests/support/dist_worker.py on every rank; rank 0 writes result.json, and in
"caches" mode every rank writes its KV cache, which the tests compare with single-process decoding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support.exactness import chi_square, exact_joint, sample_prefixes
from support.launch import free_port, mlx_launch
from support.tinymodels import make_tiny_model

import macspec
import macspec.core.verify as engine
from macspec.core import sharded as distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "support" / "dist_worker.py"
LIMIT = 240  # seconds: a launch that takes longer has hung (the machine is shared and slow)
GREEDY = {"prompt": "Once upon", "max_tokens": 40, "num_draft": 4, "adaptive": False}


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def launch(n: int, target: Path, draft: Path | None, mode: str, out: Path, opts: dict) -> dict:
    """Run the worker on n ranks with mlx.launch; rank 0's result."""
    cmd = [mlx_launch(), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port(n))]
    cmd += ["--", sys.executable, str(WORKER), str(target), str(draft or "-"), mode, str(out)]
    proc = subprocess.run(
        cmd + [json.dumps(opts)], env=env(), capture_output=True, text=True, timeout=LIMIT
    )
    result = out / "result.json"
    # mlx.launch exits 0 even when a rank fails: the result file is the proof of success.
    assert result.exists(), proc.stdout + proc.stderr
    return json.loads(result.read_text())


def spawn(n: int, target: Path, mode: str, out: Path, opts: dict, **extra: str):
    """Start n ranks directly (as mlx.launch does), so that the test controls each one."""
    base = free_port(n)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + i}"] for i in range(n)]))
    cmd = [sys.executable, str(WORKER), str(target), "-", mode, str(out), json.dumps(opts)]
    return [
        subprocess.Popen(
            cmd,
            env=env(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]


@pytest.fixture(scope="module")
def sharded_dirs(tmp_path_factory):
    """6 heads (and 6 KV heads): divisible by 2 and 3 ranks. The draft is a noisy copy."""
    root = tmp_path_factory.mktemp("dist")
    kw = {"seed": 0, "hidden": 48, "heads": 6, "kv_heads": 6, "tie": False}
    return make_tiny_model(root / "t", **kw), make_tiny_model(root / "d", perturb=0.3, **kw)


@pytest.fixture(scope="module", params=[2, 3])
def greedy_run(request, sharded_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"greedy{request.param}")
    # The adaptive-K run (with its calibration) on 2 ranks only: 3 processes on this machine's
    # shared cores are slow.
    # On 3 ranks, rank 0 also times the all-reduces inside the forward pass (it evaluates them
    # one by one): the ranks must stay in step all the same.
    opts = {**GREEDY, "adaptive_run": request.param == 2, "time_comm": request.param == 3}
    result = launch(request.param, *sharded_dirs, "caches", out, opts)
    return request.param, out, result


@pytest.mark.subprocess
def test_greedy_equals_single_process_target_only(greedy_run, sharded_dirs):
    n, _, result = greedy_run
    assert result["size"] == n
    alone = macspec.load(sharded_dirs[0])
    expected = macspec.generate(alone, GREEDY["prompt"], max_tokens=40, speculative=False)
    assert result["tokens"] == expected.tokens
    assert result["early"] == expected.tokens[: len(result["early"])]  # stopped after 2 rounds
    if n == 2:
        assert result["again"] == expected.tokens  # adaptive K, after its calibration
    assert 0 < result["accepted"] < result["drafted"]  # drafts were both kept and thrown away
    assert result["comm_time"] > 0  # the benchmark's communication time is measured


@pytest.mark.subprocess
def test_caches_identical_across_ranks_after_rejections(greedy_run, sharded_dirs, float32_kv):
    """Every rank rewound to the same length, and the shards together hold exactly the cache
    that one process decoding the same tokens holds (each rank has 6/n of the KV heads; a
    sharded target runs mlx-lm's layers, with float32 caches)."""
    n, out, result = greedy_run
    caches = [np.load(out / f"cache_{r}.npz") for r in range(n)]
    offset = result["offset"]
    assert [int(c["offset"]) for c in caches] == [offset] * n
    alone = macspec.load(sharded_dirs[0])
    ids = alone.tokenizer.encode(GREEDY["prompt"]) + result["tokens"]
    reference = make_prompt_cache(alone.target)
    alone.target(mx.array(ids[:offset])[None], cache=reference)
    for i, layer in enumerate(reference):
        for name, full in (("k", layer.keys), ("v", layer.values)):
            got = np.concatenate([c[f"{name}{i}"] for c in caches], axis=1)
            want = np.array(full[..., :offset, :])
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-4)


PROMPT = [3, 4, 5, 3]
N = 200  # launches are slow here (two processes on shared cores); N has power, see below


@pytest.mark.subprocess
def test_distribution_matches_target_distributed(tmp_path, monkeypatch):
    """Speculative sampling over 2 ranks is distributed as the target alone (chi-square).

    An unrelated draft (another seed) is rejected often, so the residual draw matters; the same
    N in one process flags a broken acceptance rule (p < 1e-5), so the check has power."""
    kw = {"chars": "abcd", "scale": 4.0, "vocab_rows": 9, "tie": False, "layers": 1}
    target = make_tiny_model(tmp_path / "t", seed=3, **kw)
    draft = make_tiny_model(tmp_path / "d", seed=4, **kw)
    opts = {"temperature": 1.0, "num_draft": 2, "adaptive": False}
    out = tmp_path / "out"
    out.mkdir()
    run = {**opts, "max_tokens": 3, "prompt": PROMPT, "seeds": N, "eos_off": True}
    result = launch(2, target, draft, "sample", out, run)
    pair = macspec.load(target, draft)
    pair.eos_token_ids = frozenset()
    expected = exact_joint(pair, PROMPT, 3, temperature=1.0)
    counts = Counter(tuple(r) for r in result["runs"])
    assert sum(counts.values()) == N
    assert chi_square(expected, counts) > 1e-3

    def resample_from_p(p, q, drafts, key):  # the classic bug: after a rejection, draw from p
        n, _ = correct(p, q, drafts, key)
        return n, mx.random.categorical(mx.log(mx.take(p, n, axis=0)), key=key)

    correct = engine.accept
    monkeypatch.setattr(engine, "accept", resample_from_p)
    assert chi_square(expected, sample_prefixes(pair, PROMPT, 3, N, **opts)) < 1e-5


def wait_all(procs, seconds: float) -> list[tuple[int, str]]:
    """(exit code, stderr) per rank; a rank still running after `seconds` is killed and fails."""
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=seconds)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


@pytest.mark.subprocess
def test_killed_rank_gives_an_error_on_rank_0(sharded_dirs, tmp_path):
    opts = {**GREEDY, "rank": 1, "after": 3, "signal": "SIGKILL"}
    procs = spawn(2, sharded_dirs[0], "die", tmp_path, opts)
    (rc0, err0), (rc1, _) = wait_all(procs, LIMIT)
    assert rc1 == -signal.SIGKILL
    assert rc0 == 1
    assert "macspec: error: rank 0: lost the connection to another rank" in err0
    assert "Traceback" not in err0


@pytest.mark.subprocess
def test_hung_rank_gives_an_error_on_rank_0_in_bounded_time(sharded_dirs, tmp_path):
    opts = {**GREEDY, "rank": 1, "after": 3, "signal": "SIGSTOP"}
    procs = spawn(2, sharded_dirs[0], "die", tmp_path, opts, MACSPEC_DIST_TIMEOUT="5")
    try:
        rc0, err0 = wait_all(procs[:1], LIMIT)[0]
    finally:
        procs[1].kill()  # a stopped process still dies of SIGKILL
        procs[1].communicate()
    assert rc0 == distributed.EXIT_HUNG
    assert "rank 0: no answer from rank 1 for 5s" in err0
    assert "a rank has died or hangs" in err0


def test_heads_must_divide_over_the_ranks(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden=48, heads=6, kv_heads=2)
    model = macspec.load(path).target
    distributed._check_divisible(model, path, 2)
    with pytest.raises(macspec.ModelError, match="num_key_value_heads=2 cannot be split over 3"):
        distributed._check_divisible(model, path, 3)


def test_no_group_outside_a_launcher(monkeypatch):
    for name in ("MLX_HOSTFILE", "MLX_RANK", "MLX_IBV_DEVICES", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    assert distributed.init_group() is None
    assert distributed.is_leader(macspec.Pair(None, None, Path(".")))


@pytest.mark.subprocess
def test_cli_under_mlx_launch_prints_on_rank_0_only(sharded_dirs):
    target, draft = sharded_dirs
    cmd = [mlx_launch(), "-n", "2", "--backend", "ring", "--starting-port", str(free_port(2))]
    cmd += ["--", sys.executable, "-m", "macspec", "generate", "--target", str(target)]
    cmd += ["--draft", str(draft), "--raw-prompt", "--json", "--max-tokens", "24", "--no-adaptive"]
    proc = subprocess.run(
        cmd + ["Once upon"],
        env=env(MACSPEC_NO_BLAS_PRELOAD="1"),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    out = json.loads(proc.stdout)  # exactly one JSON document: rank 1 printed nothing
    expected = macspec.generate(macspec.load(target), "Once upon", max_tokens=24, speculative=False)
    assert out["tokens"] == expected.tokens
    assert out["stats"]["drafted"] > 0
    assert "Traceback" not in proc.stderr


def test_leader_path_on_a_one_rank_group(tiny_dirs):
    """The messages rank 0 sends (a long prompt takes two), rewinds and timings, in-process:
    a one-rank group sums to itself, so the leader's output must equal plain single-process."""
    plain = macspec.load(*tiny_dirs)
    led = macspec.load(*tiny_dirs)
    led.group = mx.distributed.init()
    assert led.group.size() == 1
    link = distributed._LINKS.setdefault(id(led.group), distributed.Link(led.group))
    distributed.time_communication(led)
    prompt = "Once upon a time, in a land far away, there lived a" * 2  # > INLINE ids
    opts = {"max_tokens": 30, "num_draft": 3, "adaptive": False, "temperature": 0.9, "seed": 4}
    events = list(macspec.stream_generate(led, prompt, **opts))
    expected = macspec.generate(plain, prompt, **opts)
    assert [t for e in events for t in e.emitted] == expected.tokens
    assert any(e.rejected for e in events)
    assert all(e.comm_time > 0 for e in events)
    assert isinstance(link.target, distributed.LeaderTarget)
    assert link.target.offset == len(plain.tokenizer.encode(prompt)) + len(expected.tokens) - 1


def test_only_rank_0_generates(tiny_dirs):
    class Rank1:
        def rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

    pair = macspec.load(*tiny_dirs)
    pair.group = Rank1()
    assert not distributed.is_leader(pair)
    with pytest.raises(distributed.DistributedError, match="rank 1 does not generate"):
        macspec.generate(pair, "Once", max_tokens=4)
