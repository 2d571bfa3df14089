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
    logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]
) -> int:
    """Pick one token from ``logits`` ([vocab])."""
    if temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs = top_p_filter(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[Optional[torch.Generator]],
) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab]).

    Greedy rows share one batched argmax; sampled rows go one by one because each must
    draw from its own generator.
    """
    token_ids = torch.argmax(logits, dim=-1).tolist()
    for i, temperature in enumerate(temperatures):
        if temperature > 0.0:
            token_ids[i] = sample_one(logits[i], temperature, top_ps[i], generators[i])
    return token_ids


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
