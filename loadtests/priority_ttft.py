"""What `engine.scheduling_policy: priority` does for the requests that ask for it: a
burst of requests, one in four with `priority` -1 (the rest 0), all sent at once to a
torch engine with fewer slots than requests, under `fcfs` and under `priority`,
alternated round by round in one process (one engine per policy; no Serve, no HTTP: the
order is decided in the engine's scheduler, which is what this measures). Reports time
to first token per class and policy (p50 and p90 over the rounds' requests), the burst's
wall time, and each class's p50 TTFT under `priority` over its p50 under `fcfs`.

    python -m loadtests.priority_ttft [--preset small] [--rounds 3] [--requests 64]
        [--max-num-seqs 8] [--input-len 128] [--output-len 32]

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from loadtests.benchmark import percentile

POLICIES = ("fcfs", "priority")
HIGH, NORMAL = -1, 0


async def burst(engine, args, rng: random.Random, tag: str) -> tuple[dict[int, list[float]], float]:
    """Every request at once, one in four high; their TTFTs by priority, and the wall
    time of the whole burst."""
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

    ttft: dict[int, list[float]] = {HIGH: [], NORMAL: []}
    started = time.perf_counter()

    async def one(i: int) -> None:
        prompt = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        priority = HIGH if i % 4 == 3 else NORMAL
        req = GenerationRequest(f"{tag}-{i}-{rng.random()}", prompt, params, priority=priority)
        first = None
        async for _ in engine.generate(req):
            if first is None:
                first = time.perf_counter() - started
        ttft[priority].append(first)

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    return ttft, time.perf_counter() - started


async def main(args) -> None:
    from app.config import EngineConfig
    from deployments.compute.engines.torch_engine import TorchEngine
    from tests.fixtures.models import get_model_path

    model_path = get_model_path(args.preset)
    engines = {}
    for policy in POLICIES:
        print(f"[setup] starting a torch engine ({args.preset}, {args.max_num_seqs} slots, {policy})", file=sys.stderr)
        engines[policy] = TorchEngine(str(model_path), max_num_seqs=args.max_num_seqs, scheduling_policy=policy,
                                      kv_arena_bytes=EngineConfig().kv_arena_bytes)
        await engines[policy].start()
    args.vocab_size = engines["fcfs"].config.vocab_size
    rng = random.Random(args.seed)
    warm = argparse.Namespace(**{**vars(args), "requests": args.max_num_seqs})
    for policy, engine in engines.items():
        await burst(engine, warm, rng, f"warm-{policy}")
    ttft = {p: {HIGH: [], NORMAL: []} for p in POLICIES}
    walls: dict[str, list[float]] = {p: [] for p in POLICIES}
    try:
        for r in range(args.rounds):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]  # each round starts with the other
            for policy in order:
                got, wall = await burst(engines[policy], args, rng, f"{policy}-{r}")
                for priority, values in got.items():
                    ttft[policy][priority].extend(values)
                walls[policy].append(wall)
                print(f"[round {r + 1}/{args.rounds}] {policy}: {args.requests} requests in {wall:.2f} s; TTFT p50 "
                      f"high {1000 * statistics.median(got[HIGH]):.0f} ms, normal "
                      f"{1000 * statistics.median(got[NORMAL]):.0f} ms", file=sys.stderr)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    print(f"{'policy':<9} {'class':<7} {'TTFT p50 ms':>12} {'p90 ms':>8} {'burst s (median)':>17}")
    for policy in POLICIES:
        for priority, name in ((HIGH, "high"), (NORMAL, "normal")):
            values = ttft[policy][priority]
            print(f"{policy:<9} {name:<7} {1000 * statistics.median(values):>12.0f} "
                  f"{1000 * percentile(values, 90):>8.0f} {statistics.median(walls[policy]):>17.2f}")
    for priority, name in ((HIGH, "high"), (NORMAL, "normal")):
        ratio = statistics.median(ttft["priority"][priority]) / statistics.median(ttft["fcfs"][priority])
        print(f"TTFT p50 of {name} requests, priority / fcfs: {ratio:.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from app.model_builder import PRESETS

    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
