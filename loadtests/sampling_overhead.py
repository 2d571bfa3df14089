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


async def one_round(engine, variant: str, args, rng: random.Random) -> tuple[float, int]:
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

    async def one(i: int) -> int:
        prompt = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, **VARIANTS[variant])
        tokens = 0
        async for delta in engine.generate(GenerationRequest(f"{variant}-{i}-{rng.random()}", prompt, params)):
            tokens = delta.num_output_tokens
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    return time.perf_counter() - started, sum(counts)


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
        await one_round(engine, variant, argparse.Namespace(**{**vars(args), "concurrency": 2}), rng)
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.rounds):
        # Each round starts with another variant: a later place in a round ran slower.
        for variant in names[r % len(names):] + names[: r % len(names)]:
            seconds, tokens = await one_round(engine, variant, args, rng)
            rates[variant].append(tokens / seconds)
            print(f"[round {r + 1}/{args.rounds}] {variant}: {tokens} tokens in {seconds:.2f} s "
                  f"({tokens / seconds:.0f} tok/s)", file=sys.stderr)
    await engine.shutdown()
    plain = statistics.median(rates["plain"])
    print(f"{'variant':<12} {'tok/s per round':<28} {'median':>8} {'vs plain':>9}")
    for variant, values in rates.items():
        median = statistics.median(values)
        per_round = ", ".join(f"{v:.0f}" for v in values)
        print(f"{variant:<12} {per_round:<28} {median:>8.0f} {median / plain:>9.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from app.model_builder import PRESETS

    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
