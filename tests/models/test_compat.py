"""The tokenizer compatibility check: `macspec.compat` and `macspec check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tinymodels import DEFAULT_CHARS, make_tiny_model
from tokenizers import Tokenizer, processors

from macspec.base.errors import CompatError
from macspec.cli import main
from macspec.models.compat import PROBES, Mismatch, check, check_tokenizers

N_TOKENS = 3 + len(DEFAULT_CHARS)  # <pad> <s> </s>, then one id per character
N_PROBES = len(PROBES) + 1  # the built-in texts and the target's rendered chat
SWAPPED = DEFAULT_CHARS.replace("a", "#").replace("b", "a").replace("#", "b")  # ids 4 and 5 swap


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("compat") / "target", seed=0)


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_same_tokenizer_is_compatible(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", seed=1, hidden=16, layers=1)
    report = check(target, draft)
    assert report.compatible
    assert (report.errors, report.warnings) == ([], [])
    assert report.notes == ["the tokenizer files are byte-identical"]
    assert (report.target_tokens, report.draft_tokens) == (N_TOKENS, N_TOKENS)
    assert (report.mismatched_ids, report.examples) == (0, [])
    assert (report.probes, report.probes_differing) == (N_PROBES, 0)
    assert report.usable_vocab == N_TOKENS
    assert report.raise_for_errors() is report
    assert report.format().endswith("compatible: same tokenizer, speculation is exact.")


def test_padded_draft_embedding_is_compatible(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", vocab_rows=N_TOKENS + 8)
    report = check(target, draft)
    assert report.compatible and report.warnings == []
    assert (report.target_rows, report.draft_rows) == (N_TOKENS, N_TOKENS + 8)
    assert report.usable_vocab == N_TOKENS


def test_ids_naming_other_tokens_are_an_error(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", chars=SWAPPED)
    report = check(target, draft)
    assert not report.compatible
    assert report.mismatched_ids == 2
    assert report.examples == [Mismatch(4, "a", "b"), Mismatch(5, "b", "a")]
    assert report.errors == [
        f"2 of {N_TOKENS} ids name different tokens (target vs draft: id 4: 'a' vs 'b', "
        "id 5: 'b' vs 'a'); the draft would predict other text than the target reads"
    ]
    # Every probe contains an 'a' or a 'b', so every one encodes differently.
    assert report.probes_differing == N_PROBES
    with pytest.raises(CompatError, match=r"cannot draft for target .*id 4: 'a' vs 'b'") as e:
        report.raise_for_errors()
    assert str(draft) in str(e.value) and str(target) in str(e.value)


def test_draft_embedding_smaller_than_target_ids_is_an_error(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", chars=DEFAULT_CHARS[:40])  # 43 tokens and rows
    report = check(target, draft)
    assert report.mismatched_ids == 0  # a prefix of the target's vocabulary: same ids
    assert report.errors == [
        f"the target emits ids up to {N_TOKENS - 1} but the draft's embedding has only 43 rows: "
        f"ids 43..{N_TOKENS - 1} (e.g. {DEFAULT_CHARS[40]!r}) cannot be fed to the draft"
    ]
    assert report.usable_vocab == 43


def test_target_tokens_the_draft_lacks_warn_when_rows_fit(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", chars=DEFAULT_CHARS[:40], vocab_rows=N_TOKENS)
    report = check(target, draft)
    assert report.compatible
    assert report.warnings[0] == (
        f"the target's tokenizer has {N_TOKENS - 43} tokens the draft's lacks "
        f"(ids 43..{N_TOKENS - 1}, e.g. {DEFAULT_CHARS[40]!r}); the draft never learned them "
        "and will rarely propose them"
    )


def test_draft_tokens_the_target_lacks_warn(tmp_path):
    small = make_tiny_model(tmp_path / "target", chars=DEFAULT_CHARS[:40])
    draft = make_tiny_model(tmp_path / "draft")
    report = check(small, draft)
    assert report.compatible
    assert report.usable_vocab == 43
    assert report.warnings[0] == (
        f"the draft's tokenizer has {N_TOKENS - 43} tokens the target's lacks "
        f"(ids 43..{N_TOKENS - 1}, e.g. {DEFAULT_CHARS[40]!r}); drafting them wastes a position"
    )


def test_different_encoding_of_the_same_vocabulary_warns(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft")
    tok = Tokenizer.from_file(str(draft / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(draft / "tokenizer.json"))
    report = check(target, draft, probe=["ab"])
    assert report.compatible and report.mismatched_ids == 0
    assert (report.probes, report.probes_differing) == (N_PROBES + 1, N_PROBES + 1)
    assert len(report.warnings) == 1
    assert report.warnings[0].startswith(f"{N_PROBES + 1} of {N_PROBES + 1} probe texts encode ")
    # "Once upon...": the draft puts <s> (1) in front of 'O' (44), 'n' (17), 'c' (6), 'e' (8) ...
    assert (
        "from token 0 the target gives [44, 17, 6, 8, 3, 24], the draft [1, 44, 17"
        in (report.warnings[0])
    )


def test_end_of_sequence_and_chat_template_differences(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft")
    edit_json(draft / "config.json", eos_token_id=[2, 3])
    edit_json(draft / "tokenizer_config.json", chat_template="{{ messages[0]['content'] }}")
    report = check(target, draft)
    assert report.compatible
    assert report.warnings == [
        "end-of-sequence ids differ (target [2], draft [2, 3]); the target decides where output "
        "ends, the draft will mispredict the end"
    ]
    assert report.notes == [
        "chat templates differ; chats are rendered with the target's template and the draft "
        "reads that text"
    ]


def test_check_tokenizers_on_loaded_tokenizers(target, tmp_path):
    from mlx_lm.utils import load_tokenizer

    draft = make_tiny_model(tmp_path / "draft", chars=SWAPPED)
    wrapper = load_tokenizer(target)
    # A bare Hugging Face tokenizer works too; without rows only the ids are compared.
    report = check_tokenizers(wrapper, load_tokenizer(draft)._tokenizer)
    assert (report.target, report.draft) == ("target", "draft")
    assert (report.target_rows, report.draft_rows) == (None, None)
    assert report.usable_vocab == N_TOKENS
    assert report.mismatched_ids == 2 and len(report.errors) == 1
    assert check_tokenizers(wrapper, wrapper, target_rows=N_TOKENS, draft_rows=10).errors == [
        f"the target emits ids up to {N_TOKENS - 1} but the draft's embedding has only 10 rows: "
        f"ids 10..{N_TOKENS - 1} (e.g. 'g') cannot be fed to the draft"
    ]


def test_config_without_vocab_size_warns(target, tmp_path):
    draft = make_tiny_model(tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    del config["vocab_size"]
    (draft / "config.json").write_text(json.dumps(config))
    report = check(target, draft)
    assert report.draft_rows is None
    assert report.warnings == [
        "no vocab_size in the draft's config.json: rows not checked",
        "could not read the draft model to check its caches: ModelArgs.__init__() missing 1 "
        "required positional argument: 'vocab_size'",
    ]


def test_cli_compatible(target, tmp_path, capsys):
    draft = make_tiny_model(tmp_path / "draft", seed=3)
    assert main(["check", str(target), str(draft)]) == 0
    out = capsys.readouterr().out
    assert f"ids 0..{N_TOKENS - 1} name the same token in both tokenizers" in out
    assert out.rstrip().endswith("compatible: same tokenizer, speculation is exact.")


def test_cli_incompatible_exits_1(target, tmp_path, capsys):
    draft = make_tiny_model(tmp_path / "draft", chars=SWAPPED)
    assert main(["check", str(target), str(draft)]) == 1
    captured = capsys.readouterr()
    assert "error    2 of" in captured.out
    assert "INCOMPATIBLE" in captured.out
    assert captured.err == f"macspec: error: {draft} cannot draft for {target} (1 problem above)\n"


def test_cli_json_and_probe(target, tmp_path, capsys):
    draft = make_tiny_model(tmp_path / "draft", chars=SWAPPED)
    assert main(["check", str(target), str(draft), "--json", "--probe", "zzz"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["compatible"] is False
    assert data["mismatched_ids"] == 2
    assert data["examples"][0] == {"id": 4, "target": "a", "draft": "b"}
    assert data["usable_vocab"] == N_TOKENS
    assert (data["probes"], data["probes_differing"]) == (N_PROBES + 1, N_PROBES)  # 'zzz' agrees


@pytest.mark.parametrize("name", ["missing", "model.gguf", "broken"])
def test_cli_bad_model_paths(target, tmp_path, capsys, name):
    bad = tmp_path / name
    if name == "model.gguf":
        bad.write_bytes(b"GGUF")
    elif name == "broken":
        make_tiny_model(bad)
        (bad / "tokenizer.json").write_text("{not json")
    assert main(["check", str(target), str(bad)]) == 1
    err = capsys.readouterr().err
    # The store words the first two; this module the broken tokenizer.
    assert err.startswith("macspec: error: ") and str(bad) in err
    if name == "broken":
        assert f"cannot load the tokenizer in {bad}: " in err


def test_load_refuses_a_draft_with_another_tokenizer(target, tmp_path):
    import macspec

    draft = make_tiny_model(tmp_path / "draft", chars=SWAPPED)
    with pytest.raises(CompatError, match=r"id 4: 'a' vs 'b'"):
        macspec.load(str(target), str(draft))


def test_load_accepts_padded_models_and_agrees_on_the_vocabulary(tmp_path):
    import macspec

    # Both embeddings padded past the tokenizer, as real checkpoints are: padding is never sampled.
    padded = make_tiny_model(tmp_path / "target", vocab_rows=N_TOKENS + 16)
    draft = make_tiny_model(tmp_path / "draft", seed=2, vocab_rows=N_TOKENS + 8)
    pair = macspec.load(str(padded), str(draft))
    report = check(padded, draft)
    assert report.compatible
    assert pair.vocab_size == report.usable_vocab == N_TOKENS


def test_check_notes_a_pruned_draft_head(target, tmp_path, monkeypatch):
    draft = make_tiny_model(tmp_path / "draft", seed=1, hidden=16, layers=1)
    monkeypatch.setenv("MACSPEC_DRAFT_VOCAB", "20")
    note = (
        "the draft's head scores its 20 lowest ids, the special ids and the prompt's of "
        f"{N_TOKENS}; the target alone gives the others (MACSPEC_DRAFT_VOCAB=0: every id)"
    )
    assert check(target, draft).notes[-1] == note
    monkeypatch.setenv("MACSPEC_DRAFT_VOCAB", "0")
    assert check(target, draft).notes == ["the tokenizer files are byte-identical"]
