"""A Hugging Face `tokenizer.json` + `tokenizer_config.json` rebuilt from GGUF tokenizer metadata:
GPT-2-style byte-level BPE (with the pre-tokenizer regex `tokenizer.ggml.pre` names) and
SentencePiece ("llama": BPE over pieces with byte fallback), their special tokens, the chat
template, and the end-of-turn tokens generation must stop at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..base.errors import ConvertError

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> the pre-tokenizer the original Hugging Face tokenizer.json used
# (the regexes are llama.cpp's llama-vocab.cpp ones, which copy the HF tokenizers').
_GPT2_PRE = {"default", "gpt-2", "gpt2", "phi-2", "roberta-bpe", "jina-es", "jina-de"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"), _LLAMA3_RE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_RE),
    **dict.fromkeys(("tekken", "pixtral"), _TEKKEN_RE),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_RE),
}
SUPPORTED_PRE = sorted(_GPT2_PRE | _DIGITS_PRE | set(_SPLIT_PRE))

# Tokens llama.cpp (llama-vocab.cpp) treats as end of generation; the ones a chat template
# closes its turns with become stop tokens here too (Gemma's <end_of_turn>, Llama 3's <|eot_id|>).
END_OF_TURN = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "<|return|>",
)  # fmt: skip

# Gemma's own template (text turns only), for Gemma GGUF files that carry none: llama.cpp would
# fall back to ChatML there, which Gemma was never trained on.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
FALLBACK_TEMPLATES = {"gemma": GEMMA_TEMPLATE}


def _added_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    return [
        AddedToken(tok, special=t == CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (CONTROL, USER_DEFINED)
    ]


def _bpe_pre_tokenizer(pre: str, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ConvertError(
        f"{path}: unknown BPE pre-tokenizer '{pre}' (tokenizer.ggml.pre); supported: "
        + ", ".join(SUPPORTED_PRE)
    )


def _gpt2_tokenizer(meta: dict, tokens: list[str], path: Path):
    from tokenizers import Tokenizer, decoders, models, processors

    merges = meta.get("tokenizer.ggml.merges")
    if not merges or not all(isinstance(m, str) and " " in m for m in merges):
        raise ConvertError(f"{path}: BPE tokenizer without usable merges (tokenizer.ggml.merges)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as e:  # tokenizers raises for a merge of unknown tokens
        raise ConvertError(f"{path}: inconsistent BPE vocabulary/merges ({e})") from e
    tok = Tokenizer(model)
    tok.pre_tokenizer = _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _spm_merges(vocab: dict[str, int], rank: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, ordered like transformers' SentencePieceExtractor:
    by the merged piece's rank (higher first), then by the parts' ids."""
    merges = []
    for piece, pid in vocab.items():
        local = [
            (piece[:i], piece[i:], rank[pid])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int], path: Path, family: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConvertError(f"{path}: SentencePiece tokenizer lacks tokenizer.ggml.scores")
    if family == "gemma":
        # Gemma's scores do not follow its merge order, the order of the vocabulary does (as
        # transformers' GGUF loader found against the reference tokenizer).
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Merges only among normal pieces: control/byte tokens never come from merging.
    mergeable = {t: i for t, i in vocab.items() if types[i] in (NORMAL, USER_DEFINED)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(mergeable, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # As llama.cpp and SentencePiece: spaces become "▁" and each text run (also one after a special
    # token) gets a "▁" in front, even one that starts with a space (Metaspace would skip that).
    norm = [normalizers.Replace(" ", "▁")]
    if prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _check_vocab(meta: dict, path: Path) -> tuple[list[str], list[int]]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConvertError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.model/tokens missing)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise ConvertError(f"{path}: tokenizer.ggml.token_type does not match the vocabulary")
    return tokens, types


def stop_ids(meta: dict, tokens: list[str], types: list[int], template: str | None) -> list[int]:
    """EOS, EOT/EOM ids, and the end-of-turn tokens the chat template closes turns with."""
    ids = []
    for key in ("eos", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            ids.append(i)
    if template:
        index = {t: i for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)}
        ids += [index[t] for t in END_OF_TURN if t in index and t in template]
    return list(dict.fromkeys(ids))


def build_tokenizer(meta: dict, path: Path, family: str = "") -> tuple[Any, dict, list[int]]:
    """A `tokenizers.Tokenizer`, a tokenizer_config.json dict and the stop token ids, rebuilt from
    GGUF metadata."""
    from tokenizers import processors

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ConvertError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.model/tokens missing)")
    tokens, types = _check_vocab(meta, path)
    if kind == "gpt2":
        tok = _gpt2_tokenizer(meta, tokens, path)
    elif kind == "llama":
        tok = _spm_tokenizer(meta, tokens, types, path, family)
    else:
        raise ConvertError(
            f"{path}: tokenizer type '{kind}' is not supported (only 'gpt2' BPE and 'llama' "
            "SentencePiece)"
        )
    tok.add_special_tokens(_added_tokens(tokens, types))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        # Same as the HF tokenizers of these models: a template adds BOS (and EOS) when asked.
        def part(seq: str, type_id: int) -> str:
            head = f"{bos}:{type_id} " if add_bos and bos else ""
            tail = f" {eos}:{type_id}" if add_eos and eos else ""
            return f"{head}{seq}:{type_id}{tail}"

        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]
        tok.post_processor = processors.TemplateProcessing(
            single=part("$A", 0),
            pair=f"{part('$A', 0)} {part('$B', 1)}",
            special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(used)],
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    for key in ("bos", "eos", "unk", "pad"):
        if token(key) is not None:
            config[f"{key}_token"] = token(key)
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template:
        template = FALLBACK_TEMPLATES.get(family)
    if template:
        config["chat_template"] = template
    return tok, config, stop_ids(meta, tokens, types, template)
