"""Ids become text in one place (macspec/api/text.py): each RoundEvent's pieces join to its text, by
origin, with rejected drafts where they were proposed and stop strings applied."""

import pytest

import macspec
from macspec.api.text import DRAFT, REJECTED, TARGET, TextStream


class BytesTokenizer:
    """One token per UTF-8 byte, decoded with replacement like byte-level BPE tokenizers."""

    def __init__(self):
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        self.detokenizer = NaiveStreamingDetokenizer(self)

    def decode(self, ids, **kwargs):
        return bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text, **kwargs):
        return list(text.encode())


def test_a_multibyte_character_belongs_to_the_token_that_completes_it():
    text = TextStream(BytesTokenizer(), [])
    for i, byte in enumerate("hé→x".encode()):
        text.add([byte], DRAFT if i % 2 else TARGET)
    text.finalize()
    pieces = text.release(final=True)
    # h (byte 0: target), é completed by byte 2 (target), → by byte 5 (draft), x byte 6 (target)
    assert pieces == [("hé", TARGET), ("→", DRAFT), ("x", TARGET)]
    assert text.peek(list("é".encode())) == "é"


def test_rejected_drafts_sit_where_they_were_proposed():
    text = TextStream(BytesTokenizer(), [])
    text.add(list(b"ab"), DRAFT)
    at = len(text.text)
    rejected = text.peek(list(b"zz"))
    text.add(list(b"c"), TARGET)
    pieces = text.release(False, rejected, at)
    assert pieces == [("ab", DRAFT), ("zz", REJECTED), ("c", TARGET)]


def test_a_stop_string_tail_is_held_back_then_cut():
    text = TextStream(BytesTokenizer(), ["END"])
    text.add(list(b"abcE"), TARGET)
    assert text.release(False) == [("abc", TARGET)]  # "E" may begin "END"
    taken, stopped = text.add(list(b"NDxy"), DRAFT)
    assert (taken, stopped) == (2, True)
    assert text.release(True) == []  # the stop string and what follows are never released


@pytest.mark.parametrize("stop", [None, "e"])
def test_event_pieces_join_to_the_text_and_follow_the_ids(pair, stop):
    options = {"max_tokens": 40, "num_draft": 3, "adaptive": False, "seed": 1, "stop": stop}
    result = macspec.generate(pair, "Once upon a time", **options)
    joined, rejected_rounds, emitted = [], 0, 0
    for i, ev in enumerate(macspec.stream_generate(pair, "Once upon a time", **options)):
        assert ev.text == "".join(t for t, o in ev.pieces if o != REJECTED)
        joined.append(ev.text)
        origins = [o for _, o in ev.pieces]
        assert (REJECTED in origins) <= bool(ev.rejected)
        rejected_rounds += REJECTED in origins
        emitted += len(ev.emitted)
        # the running statistics after this round, as the engine counts them
        assert (ev.stats.rounds, ev.stats.generated_tokens) == (i + 1, emitted)
    assert "".join(joined) == result.text
    counts = ("rounds", "drafted", "accepted", "generated_tokens", "per_position_acceptance")
    assert [getattr(ev.stats, k) for k in counts] == [getattr(result.stats, k) for k in counts]
    assert stop is not None or rejected_rounds > 0
