"""Structured output for the torch engine: a reply held to a JSON schema, to any JSON
object, to a regular expression or to one of a list of strings.

Built on xgrammar (the library vLLM's default structured-output backend uses, at the
version vLLM pins), and compiled the way vLLM's xgrammar backend compiles each kind with
``disable_any_whitespace`` (which the vLLM engine sets), so both engines hold a reply to
the same grammar: JSON comes compact (no whitespace between tokens: a small model given
free whitespace can spend every token on it), a JSON object is the schema
``{"type": "object"}``, and a choice is an EBNF alternation of the escaped strings.

Each step, the request's matcher writes a bitmask of the tokens the grammar allows next;
the logits of every other token become -inf before sampling, and the sampled token is
fed back to the matcher. Once the grammar is complete it allows only an end-of-sequence
token, and accepting one ends the request with finish reason ``stop``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# What SamplingParams.structured_output may name, as (kind, spec):
#   ("json", schema as a JSON string), ("json_object", None), ("regex", pattern),
#   ("choice", list of strings).
KINDS = ("json", "json_object", "regex", "choice")


def choice_as_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of ``choices`` (vLLM's
    ``choice_as_grammar``: the same escapes)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    return "root ::= " + " | ".join('"' + "".join(escape(c) for c in s) + '"' for s in choices)


# xgrammar's messages start with a time and a C++ source position; an assertion's also
# with the check that failed.
_NOISE = re.compile(r"\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


def clean_reason(error: Exception) -> str:
    """xgrammar's message without its time and source position."""
    return " ".join(_NOISE.sub("", str(error)).split())[:300]


class GrammarCompiler:
    """One engine's compiler (its tokenizer's vocabulary, a cache of compiled grammars)."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    @classmethod
    def for_checkpoint(cls, path: str, vocab_size: int) -> "GrammarCompiler":
        """With transformers' tokenizer of the checkpoint, which xgrammar reads its vocabulary
        from (a tokenizer of its own: the engine's may be in use on another thread, and
        with the native model it is not transformers')."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), vocab_size)

    def compile(self, kind: str, spec: Any):
        """The compiled grammar; ValueError naming what is wrong with ``spec``."""
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(choice_as_grammar(list(spec)))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with its reason
            raise ValueError(f"cannot compile the {kind} constraint: {clean_reason(e)}") from None
        raise ValueError(f"unknown structured output kind {kind!r}; known: {', '.join(KINDS)}")

    def constraint(self, compiled) -> "Constraint":
        return Constraint(self._xgr, compiled, self.vocab_size)


class Constraint:
    """One request's place in its grammar."""

    def __init__(self, xgr, compiled, vocab_size: int):
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, the logits ([1, vocab], float32, CPU) of every token the
        grammar does not allow next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()
