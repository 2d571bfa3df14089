"""Sampling: exact greedy, seeded reproducibility (batch-independent), top-p support."""

import torch

from deployments.compute.engines.protocol import SamplingParams
from deployments.compute.engines.sampling import (
    adjust_logits,
    adjusts_logits,
    make_generator,
    sample,
    sample_one,
    token_logprobs,
    top_p_filter,
)


def random_logits(batch: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exact_argmax_and_draws_nothing():
    logits = random_logits(5)
    gens = [make_generator(1) for _ in range(5)]
    states = [g.get_state().clone() for g in gens]
    assert sample(logits, [0.0] * 5, [1.0] * 5, gens) == logits.argmax(-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


def test_seeded_sampling_repeats_and_ignores_batch_neighbours():
    logits = random_logits(4)

    def draw_alone(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(logits[1:2], [1.0], [1.0], [gen])[0] for _ in range(30)]

    def draw_in_batch(seed: int) -> list[int]:
        gens = [make_generator(None), make_generator(seed), None, make_generator(99)]
        temps, top_ps = [0.7, 1.0, 0.0, 1.3], [0.9, 1.0, 1.0, 0.5]
        return [sample(logits, temps, top_ps, gens)[1] for _ in range(30)]

    alone = draw_alone(42)
    assert alone == draw_alone(42)
    assert alone == draw_in_batch(42)
    assert alone != draw_alone(43)  # 30 draws from 50 tokens: a collision is ~impossible


def test_unseeded_generators_differ():
    a = [int(torch.randint(0, 1 << 30, (1,), generator=make_generator(None))) for _ in range(3)]
    assert len(set(a)) == 3


def test_top_p_filter_keeps_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    kept = top_p_filter(probs, 0.7)
    assert torch.allclose(kept, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    # The top token always survives, even for a tiny top_p.
    assert top_p_filter(probs, 1e-6).nonzero().flatten().tolist() == [1]
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_top_p_restricts_sampled_support():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    gen = make_generator(0)
    seen = {sample_one(logits, 1.0, 0.7, gen) for _ in range(400)}
    assert seen == {1, 3}
    seen_all = {sample_one(logits, 1.0, 1.0, gen) for _ in range(400)}
    assert seen_all == {0, 1, 2, 3}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    gen = make_generator(5)
    cold = [sample_one(logits, 0.01, 1.0, gen) for _ in range(200)]
    hot = [sample_one(logits, 100.0, 1.0, gen) for _ in range(600)]
    assert set(cold) == {0}
    assert min(hot.count(t) for t in range(3)) > 120  # close to uniform


def test_token_logprobs_are_the_raw_log_softmax_of_the_rows_asked_for():
    logits = random_logits(4)
    expected = torch.log_softmax(logits, dim=-1)
    out = token_logprobs(logits, [1, 3], [7, 2], [3, 0])
    assert len(out) == 2
    (chosen, top), (chosen3, top3) = out
    assert chosen == expected[1, 7].item() and chosen3 == expected[3, 2].item()
    values, ids = expected[1].topk(3)
    assert top == list(zip(ids.tolist(), values.tolist()))  # most likely first
    assert top3 == []


def test_adjust_logits_applies_bias_min_tokens_and_penalties_in_vllms_order():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(max_tokens=9, logit_bias={1: 4.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    # Prompt [0]; output [3, 3]; token 4 ends sequences.
    after_params = SamplingParams(max_tokens=9, min_tokens=2, repetition_penalty=2.0)
    plain = SamplingParams(max_tokens=9, presence_penalty=1.0)
    # Prompt [0]; output [3, 3]; token 4 ends sequences. Three rows at once.
    out = adjust_logits(torch.stack([logits] * 3), [params, after_params, plain],
                        [[0], [4], [0]], [[3, 3], [1, 1], []], [[4], [4], [4]])
    # bias: token 1 -> 3.0; min_tokens: 4 -> -inf; repetition on {0, 3} (positive: halved);
    # then token 3 loses 2 * 0.5 (frequency) + 0.25 (presence).
    assert out[0].tolist() == [1.0, 3.0, 0.5, 1.5 - 1.25, float("-inf")]
    assert out[1].tolist() == [2.0, -2.0, 0.5, 3.0, -4.0]  # min_tokens reached; negative: doubled
    assert out[2].tolist() == logits.tolist()  # no output yet: nothing to penalise
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the caller's row is untouched
    assert not adjusts_logits(SamplingParams(max_tokens=9, min_tokens=2), 2)
    assert adjusts_logits(SamplingParams(max_tokens=9, min_tokens=2), 1)
    assert not adjusts_logits(SamplingParams(max_tokens=9, top_k=3, min_p=0.1), 0)


def test_top_k_and_min_p_keep_only_the_likely_tokens():
    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])
    draws = lambda **kw: {sample_one(logits, 1.0, 1.0, make_generator(s), **kw) for s in range(200)}  # noqa: E731
    assert draws() >= {0, 1, 2}
    assert draws(top_k=1) == {1}
    assert draws(top_k=2) == {1, 2}
    # min_p 0.5: p(2) / p(1) = e^-0.1 stays, p(0) / p(1) = e^-3 goes.
    assert draws(min_p=0.5) == {1, 2}


def test_allowed_token_ids_rule_out_every_other_token_before_the_bias():
    """vLLM's allowed_token_ids: every other token's logit is -inf (then the bias goes on
    the allowed ones, as vLLM applies its mask first); rows without it are untouched."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    allowed = SamplingParams(max_tokens=9, allowed_token_ids=[1, 2], logit_bias={2: 1.0, 3: 5.0})
    plain = SamplingParams(max_tokens=9, logit_bias={0: 1.0})
    out = adjust_logits(torch.stack([logits] * 2), [allowed, plain], [[0], [0]], [[], []], [[4], [4]])
    inf = float("-inf")
    assert out[0].tolist() == [inf, -1.0, 1.5, inf, inf]
    assert out[1].tolist() == [3.0, -1.0, 0.5, 3.0, -2.0]
    assert adjusts_logits(SamplingParams(max_tokens=9, allowed_token_ids=[1]), 5)
    # Greedy and sampled picks stay among them.
    for seed in range(20):
        picks = sample(out[:1].expand(2, -1).clone(), [0.0, 1.0], [1.0, 1.0], [None, make_generator(seed)])
        assert picks[0] == 2 and picks[1] in (1, 2)
