"""vLLM's ``bad_words`` (``SamplingParams.bad_words``): the words a reply may not contain,
as token sequences, and the tokens they rule out at a step. Pure (no torch): the ingress
checks a request's words with it, the torch engine applies them."""

from __future__ import annotations

from typing import Sequence

# vLLM's VLLM_MAX_NUM_BAD_WORDS (its default): token sequences a request's bad_words make.
MAX_BAD_WORD_SEQUENCES = 128


def bad_words_token_ids(encode, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of ``words`` as vLLM makes them
    (``SamplingParams.update_from_tokenizer``): each word with its leading whitespace
    stripped, then also with one space in front where that is a different first token of
    as many tokens (a word at the start of the text, and in the middle of it).
    ``encode``: text -> ids without special tokens. ValueError for a word that makes no
    token, or more than ``MAX_BAD_WORD_SEQUENCES`` sequences in all."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):  # vLLM drops repeats
        for space in ("", " "):
            ids = list(encode(space + word.lstrip()))
            if not ids:
                if not space:
                    raise ValueError(f"bad_words entries must tokenize to at least one token; {word[:40]!r} does not")
                continue
            if not space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_BAD_WORD_SEQUENCES:
                    raise ValueError(
                        f"bad_words make more than {MAX_BAD_WORD_SEQUENCES} token sequences (each word one or two)"
                    )
    return out


def banned_tokens(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens a reply that so far is ``output_ids`` may not take next: the last token
    of each bad-word sequence whose other tokens the reply ends with (vLLM's
    ``apply_bad_words``: the reply's own tokens only, never the prompt's)."""
    banned = []
    for seq in sequences:
        n = len(seq) - 1
        if n <= len(output_ids) and (n == 0 or list(output_ids[-n:]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned
