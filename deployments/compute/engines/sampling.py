"""Token sampling for the torch engine: greedy, temperature, top-p, per-request seeds.

Each request owns a ``torch.Generator`` and draws exactly one random number vector per
generated token from it, so a seeded request yields the same tokens whichever batch it
lands in (its draws never depend on its neighbours). Greedy (``temperature == 0``) is
plain argmax and touches no generator.
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import torch


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``seed``, or with fresh OS randomness when it is None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability reaches ``top_p``,
    then renormalise. ``probs``: [vocab]. The most likely token always survives."""
    if top_p >= 1.0:
        return probs
    sorted_probs, sorted_idx = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    # Keep a token if the mass before it is still below top_p.
    keep_sorted = (cumulative - sorted_probs) < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted).scatter(0, sorted_idx, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum()


def sample_one(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: Optional[torch.Generator],
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    """Pick one token from ``logits`` ([vocab]): temperature, then min_p, top_k and top_p
    (each on what the one before left, as vLLM's sampler)."""
    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / temperature
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    probs = top_p_filter(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[Optional[torch.Generator]],
    top_ks: Optional[Sequence[int]] = None,
    min_ps: Optional[Sequence[float]] = None,
) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab]).

    Greedy rows share one batched argmax; sampled rows go one by one because each must
    draw from its own generator.
    """
    token_ids = torch.argmax(logits, dim=-1).tolist()
    for i, temperature in enumerate(temperatures):
        if temperature > 0.0:
            token_ids[i] = sample_one(
                logits[i], temperature, top_ps[i], generators[i],
                top_ks[i] if top_ks else 0, min_ps[i] if min_ps else 0.0,
            )
    return token_ids


def adjusts_logits(params, num_output: int) -> bool:
    """Whether ``adjust_logits`` would change this request's logits at this step."""
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or num_output < params.min_tokens
    )


def adjust_logits(
    logits: torch.Tensor,
    params,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """One row's logits ([vocab]) with a request's logit bias, min_tokens and penalties
    applied (protocol.SamplingParams), as vLLM applies them: bias; the end-of-sequence
    ids ruled out while the output is shorter than min_tokens; the repetition penalty on
    tokens of the prompt or the output; then frequency and presence on the output's."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype))
    if len(output_ids) < params.min_tokens and stop_ids:  # EOS and stop_token_ids
        logits[list(stop_ids)] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen |= torch.bincount(torch.tensor(list(prompt_ids), dtype=torch.long), minlength=vocab)[:vocab] > 0
            penalty = torch.where(seen, params.repetition_penalty, 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], ks: Sequence[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each of ``rows`` of ``logits`` ([batch, vocab]): the log-probability of the
    token picked there and the ``k`` most likely tokens with theirs (protocol.TokenLogprobs).
    Of the raw distribution, before temperature and top-p (vLLM's default)."""
    logprobs = torch.log_softmax(logits[list(rows)].float(), dim=-1)
    out = []
    for j, (token_id, k) in enumerate(zip(token_ids, ks)):
        top: list[tuple[int, float]] = []
        if k:
            values, ids = logprobs[j].topk(k)
            top = list(zip(ids.tolist(), values.tolist()))
        out.append((float(logprobs[j, token_id]), top))
    return out
