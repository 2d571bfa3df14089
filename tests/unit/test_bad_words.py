"""vLLM's ``bad_words`` as token sequences (deployments/compute/engines/bad_words.py):
the sequences vLLM's own ``SamplingParams.update_from_tokenizer`` makes with the same
tokenizer, and the tokens they rule out at a step."""

from __future__ import annotations

import importlib.util

import pytest

from deployments.compute.engines.bad_words import MAX_BAD_WORD_SEQUENCES, bad_words_token_ids, banned_tokens

WORDS = ["river", " the sea", "old mill", "x", "  leading spaces", "river"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_sequences_are_vllms_own(tokenizer, tiny_model_path):
    import vllm
    from vllm.tokenizers.registry import get_tokenizer

    theirs = vllm.SamplingParams(max_tokens=1, bad_words=list(WORDS))
    theirs.update_from_tokenizer(get_tokenizer(str(tiny_model_path)))  # vLLM's wrapper of the same tokenizer
    ours = bad_words_token_ids(encode(tokenizer), WORDS)
    assert ours == theirs._bad_words_token_ids
    assert len(ours) > len(set(WORDS))  # some words with and without a leading space


def test_a_word_of_no_token_and_too_many_sequences_are_refused(tokenizer):
    with pytest.raises(ValueError, match="at least one token"):
        bad_words_token_ids(encode(tokenizer), ["ok", "   "])
    many = [f"w{i}" for i in range(MAX_BAD_WORD_SEQUENCES)]  # each one or two sequences
    with pytest.raises(ValueError, match=str(MAX_BAD_WORD_SEQUENCES)):
        bad_words_token_ids(encode(tokenizer), many)


def test_the_last_token_of_a_sequence_is_banned_where_the_reply_ends_with_the_rest():
    seqs = [[7], [1, 2, 3], [2, 9]]
    assert banned_tokens(seqs, []) == [7]  # only a one-token word at the start
    assert banned_tokens(seqs, [5, 1]) == [7]
    assert banned_tokens(seqs, [5, 1, 2]) == [7, 3, 9]
    assert banned_tokens(seqs, [1, 2, 4]) == [7]
    assert banned_tokens(seqs, [2]) == [7, 9]
