"""Structured output in the torch engine (engines/structured.py): the grammars it compiles
are the ones vLLM's xgrammar backend compiles, and a request's constraint masks what its
grammar rules out and ends on an end-of-sequence token."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from deployments.compute.engines.structured import GrammarCompiler, choice_as_grammar


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def compiler(tiny_model_path):
    return GrammarCompiler.for_checkpoint(tiny_model_path, AutoConfig.from_pretrained(tiny_model_path).vocab_size)


def allowed(constraint, vocab_size: int) -> list[int]:
    logits = torch.zeros(1, vocab_size)
    constraint.mask(logits)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_a_choice_grammar_is_vllms():
    vllm_utils = pytest.importorskip("vllm.v1.structured_output.utils")
    choices = ['say "yes"', "back\\slash", "tab\there", "nul\x00", "plain"]
    assert choice_as_grammar(choices) == vllm_utils.choice_as_grammar(choices)


def test_a_constraint_allows_only_what_the_grammar_does_and_then_ends(compiler, tok):
    constraint = compiler.constraint(compiler.compile("choice", ["yes", "no"]))
    chosen = []
    while not constraint.terminated:
        ok = allowed(constraint, compiler.vocab_size)
        assert ok and len(ok) < compiler.vocab_size
        assert constraint.accept(ok[-1])  # any allowed token keeps the reply in the grammar
        chosen.append(ok[-1])
        assert len(chosen) < 10
    assert tok.decode(chosen, skip_special_tokens=True) in ("yes", "no")
    assert chosen[-1] == tok.eos_token_id  # the end of sequence completes it
    fresh = compiler.constraint(compiler.compile("choice", ["yes", "no"]))
    outside = next(t for t in range(compiler.vocab_size) if t not in allowed(fresh, compiler.vocab_size))
    assert not fresh.accept(outside)


def test_json_is_compact_and_a_bad_spec_is_named(compiler, tok):
    constraint = compiler.constraint(compiler.compile("json", json.dumps({"type": "object"})))
    first = allowed(constraint, compiler.vocab_size)
    assert {tok.decode([t]) for t in first} <= {"{", "{\""}  # no whitespace in front
    with pytest.raises(ValueError, match="Unsupported type"):
        compiler.compile("json", '{"type": "nonsense"}')
    with pytest.raises(ValueError, match="regex.*parenthesis"):
        compiler.compile("regex", "(")
    with pytest.raises(ValueError, match="unknown structured output kind"):
        compiler.compile("grammar", "root ::= x")
