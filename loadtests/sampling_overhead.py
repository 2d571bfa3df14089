"""What the sampling features cost the torch engine: output tokens/s of one batch of
concurrent requests with plain sampling, with logprobs (top 5), with penalties and a
logit bias, and held to a JSON schema (structured output), alternated round by round in
one process on one engine (no Serve, no HTTP; each round starts with the next variant),
and each variant's ratio to plain.

    python -m loadtests.sampling_overhead [--preset small] [--rounds 3] [--concurrency 16]
        [--input-len 128] [--output-len 64]

The JSON schema is an object of 16 free string fields, so replies stay inside it for the
whole output length (a schema the reply could complete would end requests early and
make the variant look faster). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Optional, Sequence

VARIANTS = {
    "plain": {},
    "logprobs5": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                  "logit_bias": {11: 2.0, 12: -2.0}},
    "json_schema": {"structured_output": ("json", json.dumps({
        "type": "object",
        "properties": {f"field_{i}": {"type": "string"} for i in range(16)},
        "required": [f"field_{i}" for i in range(16)],
    }))},
}


async def one_round(
    engine, args, rng: random.Random, *, tag: str, sampling: Optional[dict] = None, loras: Sequence = (None,)
) -> tuple[float, int]:
    """``args.concurrency`` greedy requests of ``args.input_len`` random tokens and
    ``args.output_len`` output tokens at once: seconds and output tokens. ``sampling``:
    more SamplingParams fields; request ``i`` runs with adapter ``loras[i % len(loras)]``
    (None: the base model). Also what ``loadtests.lora_overhead`` runs."""
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

    async def one(i: int) -> int:
        prompt = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, **(sampling or {}))
        request = GenerationRequest(f"{tag}-{i}-{rng.random()}", prompt, params, lora=loras[i % len(loras)])
        tokens = 0
        async for delta in engine.generate(request):
            tokens = delta.num_output_tokens
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    return time.perf_counter() - started, sum(counts)


async def alternate(names: list[str], rounds: int, run) -> dict[str, list[float]]:
    """Output tokens/s of ``await run(name)`` (seconds, tokens) for every name in each of
    ``rounds`` rounds, each round starting with the next name (a later place in a round
    ran slower); one progress line a run on stderr."""
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            seconds, tokens = await run(name)
            rates[name].append(tokens / seconds)
            print(f"[round {r + 1}/{rounds}] {name}: {tokens} tokens in {seconds:.2f} s "
                  f"({tokens / seconds:.0f} tok/s)", file=sys.stderr)
    return rates


def print_table(rates: dict[str, list[float]], per_round_width: int = 28) -> None:
    """Each variant's tok/s per round, median and ratio to ``plain``'s median."""
    plain = statistics.median(rates["plain"])
    print(f"{'variant':<12} {'tok/s per round':<{per_round_width}} {'median':>8} {'vs plain':>9}")
    for variant, values in rates.items():
        median = statistics.median(values)
        per_round = ", ".join(f"{v:.0f}" for v in values)
        print(f"{variant:<12} {per_round:<{per_round_width}} {median:>8.0f} {median / plain:>9.2f}")


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The options of the batch both this and ``loadtests.lora_overhead`` run."""
    from app.model_builder import PRESETS

    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


async def main(args) -> None:
    from app.config import EngineConfig
    from deployments.compute.engines.torch_engine import TorchEngine
    from tests.fixtures.models import get_model_path

    model_path = get_model_path(args.preset)
    engine = TorchEngine(str(model_path), max_num_seqs=max(32, args.concurrency),
                         kv_arena_bytes=EngineConfig().kv_arena_bytes)
    await engine.start()
    args.vocab_size = engine.config.vocab_size
    rng = random.Random(args.seed)
    for variant in VARIANTS:  # warm-up: kernels, the grammar compiler and its cache
        await one_round(engine, argparse.Namespace(**{**vars(args), "concurrency": 2}), rng,
                        tag=variant, sampling=VARIANTS[variant])

    async def run(variant: str) -> tuple[float, int]:
        return await one_round(engine, args, rng, tag=variant, sampling=VARIANTS[variant])

    rates = await alternate(list(VARIANTS), args.rounds, run)
    await engine.shutdown()
    print_table(rates)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_batch_args(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
