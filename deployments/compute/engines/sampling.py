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
        or params.allowed_token_ids
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or num_output < params.min_tokens
    )


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Rows of logits ([rows, vocab]) with their requests' allowed tokens, logit bias,
    min_tokens and penalties applied (protocol.SamplingParams; row j is ``params[j]``'s), as
    vLLM applies them: every token but the allowed ones ruled out; bias; the
    end-of-sequence ids ruled out while the output is shorter than
    min_tokens; the repetition penalty on tokens of the prompt or the output; then
    frequency and presence on the output's. The penalties go over all rows at once, and
    only where a row's tokens are (row by row over the whole vocabulary they cost ~0.1 ms
    a row, 9% of a 16-request step of the small model here)."""
    logits = logits.float().clone()
    rows, vocab = logits.shape
    # Only the tokens named (biased, ending, seen) change: these touch those positions of
    # the flattened rows alone, a few hundred per row, never the whole vocabulary.
    flat = logits.view(-1)
    for j, p in enumerate(params):
        if p.allowed_token_ids:
            ruled_out = torch.ones(vocab, dtype=torch.bool)
            ruled_out[list(p.allowed_token_ids)] = False
            logits[j, ruled_out] = float("-inf")
    biased = [(j * vocab + t, b) for j, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if biased:
        at, bias = zip(*biased)
        flat.index_put_((torch.tensor(at),), torch.tensor(bias, dtype=logits.dtype), accumulate=True)
    for j, p in enumerate(params):
        if len(output_ids[j]) < p.min_tokens and stop_ids[j]:  # EOS and stop_token_ids
            logits[j, list(stop_ids[j])] = float("-inf")
    if not any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        return logits

    def positions(lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's position in ``flat`` and its row, one entry per occurrence."""
        lengths = torch.tensor([len(ids) for ids in lists])
        row_of = torch.repeat_interleave(torch.arange(rows), lengths)
        ids = torch.tensor([t for ids in lists for t in ids], dtype=torch.long)
        return row_of * vocab + ids, row_of

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in params], dtype=logits.dtype)

    out_at, out_row = positions(output_ids)
    repetition = column("repetition_penalty")
    if bool((repetition != 1.0).any()):
        prompts = [ids if p.repetition_penalty != 1.0 else () for p, ids in zip(params, prompt_ids)]
        prompt_at, _ = positions(prompts)
        seen = torch.unique(torch.cat([out_at, prompt_at]))
        penalty = repetition[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    # Frequency per occurrence, presence once per token seen in the output.
    flat.index_put_((out_at,), -column("frequency_penalty")[out_row], accumulate=True)
    once = torch.unique(out_at)
    flat[once] -= column("presence_penalty")[once // vocab]
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


# Prompt positions whose log-softmax is taken at once (a [rows, vocab] float32 block).
_PROMPT_LOGPROB_ROWS = 512


def prompt_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list:
    """protocol.PromptLogprob of each of ``token_ids`` (the prompt's tokens after the
    first) from ``logits`` ([len(token_ids), vocab]: row j the logits after the prompt's
    first j + 1 tokens): its log-probability, its rank (1 + the tokens more likely) and the
    ``k`` most likely tokens. Of the raw distribution, as vLLM's prompt logprobs; taken a
    block of rows at a time, so a long prompt never holds its whole vocabulary-wide
    float32 copy at once."""
    out: list = []
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    for start in range(0, len(ids), _PROMPT_LOGPROB_ROWS):
        block = torch.log_softmax(logits[start : start + _PROMPT_LOGPROB_ROWS].float(), dim=-1)
        chosen = block.gather(1, ids[start : start + len(block), None].to(block.device)).squeeze(1)
        ranks = (block > chosen[:, None]).sum(dim=1) + 1
        if k:
            values, top_ids = block.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in range(len(block))]
        out.extend(zip(chosen.tolist(), ranks.tolist(), tops))
    return out
