"""Incremental detokenization: UTF-8 holdback and stop strings across token boundaries.

Tokens are single bytes here (the worst case of byte-level BPE), so every multi-byte
character is split across tokens.
"""

import pytest

from deployments.compute.engines.detokenizer import IncrementalDetokenizer


def byte_decode(token_ids: list[int]) -> str:
    return bytes(token_ids).decode("utf-8", errors="replace")


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add_tokens(chunk).text for chunk in chunks]


def test_partial_utf8_is_held_back():
    detok = IncrementalDetokenizer(byte_decode)
    tokens = byte_tokens("é🙂a")  # 2 + 4 + 1 bytes
    outs = stream(detok, [[t] for t in tokens])
    assert outs == ["", "é", "", "", "", "🙂", "a"]
    assert "\ufffd" not in "".join(outs)


def test_flush_releases_incomplete_tail_as_replacement():
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.add_tokens(byte_tokens("ok") + [0xE2, 0x82]).text == "ok"
    assert detok.flush() == "\ufffd"


def test_stop_string_across_tokens_never_streams_a_part_of_it():
    detok = IncrementalDetokenizer(byte_decode, stop=["###"])
    chunks = [byte_tokens("Hello #"), byte_tokens("#"), byte_tokens("#tail")]
    outs = [detok.add_tokens(c) for c in chunks]
    assert [o.text for o in outs] == ["Hello ", "", ""]
    assert [o.stop for o in outs] == [None, None, "###"]
    assert detok.text == "Hello "
    assert detok.stopped == "###"
    assert detok.add_tokens(byte_tokens("more")).text == ""


def test_text_before_stop_in_same_token_is_emitted():
    detok = IncrementalDetokenizer(byte_decode, stop=["END"])
    out = detok.add_tokens(byte_tokens("abcENDdef"))
    assert (out.text, out.stop) == ("abc", "END")


def test_held_back_prefix_is_released_when_it_does_not_complete():
    detok = IncrementalDetokenizer(byte_decode, stop=["abc"])
    assert stream(detok, [byte_tokens("xa"), byte_tokens("b"), byte_tokens("x")]) == ["x", "", "abx"]
    assert detok.stopped is None


def test_flush_releases_held_back_prefix_at_length_finish():
    detok = IncrementalDetokenizer(byte_decode, stop=["stop"])
    assert detok.add_tokens(byte_tokens("go st")).text == "go "
    assert detok.flush() == "st"


def test_earliest_stop_wins():
    detok = IncrementalDetokenizer(byte_decode, stop=["zz", "b"])
    out = detok.add_tokens(byte_tokens("a zz b"))
    assert (out.text, out.stop) == ("a ", "zz")


@pytest.mark.parametrize("text", ["plain words", "café naïve über", "日本 🙂 → €5"])
def test_stream_concatenates_to_full_decode_with_real_tokenizer(tiny_model_path, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    token_ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True))
    outs = [detok.add_tokens([t]).text for t in token_ids]
    outs.append(detok.flush())
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs)


def test_clean_text_before_a_split_character_is_not_delayed():
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.add_tokens(byte_tokens("ok") + [0xE2]).text == "ok"
    assert detok.add_tokens([0x82]).text == ""
    assert detok.add_tokens([0xAC, ord("!")]).text == "€!"


def test_a_stop_string_counts_only_after_min_tokens():
    """vLLM's rule: stop strings are looked for once the output has more than min_tokens
    tokens, and text from before then is not searched again."""
    detok = IncrementalDetokenizer(byte_decode, stop=["X"], min_tokens=3)
    outs = [detok.add_tokens(byte_tokens(c)) for c in ["a", "X", "b", "cXd"]]
    assert [o.stop for o in outs] == [None, None, None, "X"]
    assert detok.text == "aXbc"


def test_include_stop_ends_the_output_after_the_stop_string_and_holds_nothing_back():
    """vLLM's include_stop_str_in_output: the output ends just after the earliest stop
    string, and a possible start of one streams at once (nothing to keep it from)."""
    detok = IncrementalDetokenizer(byte_decode, stop=["###", "ab"], include_stop=True)
    outs = [detok.add_tokens(c) for c in (byte_tokens("Hello #"), byte_tokens("#"), byte_tokens("#tail ab"))]
    assert [o.text for o in outs] == ["Hello #", "#", "#"]
    assert outs[-1].stop == "###" and detok.text == "Hello ###"
    assert detok.add_tokens(byte_tokens("more")).text == "" and detok.flush() == ""
    same_token = IncrementalDetokenizer(byte_decode, stop=["END"], include_stop=True).add_tokens(byte_tokens("xENDy"))
    assert (same_token.text, same_token.stop) == ("xEND", "END")
