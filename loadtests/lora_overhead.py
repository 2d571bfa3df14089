"""What serving LoRA adapters costs an engine: output tokens/s of one batch of
concurrent greedy requests on an engine without adapters (``plain``), and on one with two
adapters loaded (ranks 8 and 16, every projection of every layer) serving the base model
(``lora:base``), one adapter for the whole batch (``lora:one``) and the base model and
both adapters mixed in the batch (``lora:mixed``, a third each), alternated round by
round in one process (no Serve, no HTTP; each round starts with the next variant), and
each variant's ratio to ``plain``.

    python -m loadtests.lora_overhead [--engine torch|vllm] [--preset small] [--rounds 3]
        [--concurrency 16] [--input-len 128] [--output-len 64]

The adapters are random (``app.model_builder.build_lora_adapter``), built into a
temporary directory. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "plain": ("plain", [None]),
    "lora:base": ("lora", [None]),
    "lora:one": ("lora", ["r8"]),
    "lora:mixed": ("lora", [None, "r8", "r16"]),
}


async def one_round(engine, models: list, args, rng: random.Random) -> tuple[float, int]:
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

    async def one(i: int) -> int:
        prompt = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"r{i}-{rng.random()}", prompt, params, lora=models[i % len(models)])
        tokens = 0
        async for delta in engine.generate(request):
            tokens = delta.num_output_tokens
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    return time.perf_counter() - started, sum(counts)


def make_engine(kind: str, model_path: Path, adapters: dict, args):
    from app.config import AppConfig, EngineConfig

    if kind == "torch":
        from deployments.compute.engines.torch_engine import TorchEngine

        return TorchEngine(str(model_path), max_num_seqs=max(32, args.concurrency),
                           kv_arena_bytes=EngineConfig().kv_arena_bytes, lora_modules=adapters)
    from deployments.compute.engines.vllm_engine import VLLMEngine

    config = AppConfig.model_validate({
        "model": {"path": str(model_path), "lora_modules": [{"name": n, "path": p} for n, p in adapters.items()]},
        "engine": {"name": "vllm", "max_num_seqs": max(32, args.concurrency),
                   "vllm": {"enforce_eager": True, "cpu_kv_cache_space_gib": 1}},
        "dataplane": {"enabled": False},
    })
    return VLLMEngine.from_app_config(config)


async def main(args) -> None:
    from app.model_builder import build_lora_adapter
    from tests.fixtures.models import get_model_path

    model_path = get_model_path(args.preset)
    with tempfile.TemporaryDirectory(prefix="lora-overhead-") as tmp:
        adapters = {
            "r8": str(build_lora_adapter(model_path, Path(tmp) / "r8", rank=8, seed=1)),
            "r16": str(build_lora_adapter(model_path, Path(tmp) / "r16", rank=16, seed=2)),
        }
        engines = {"plain": make_engine(args.engine, model_path, {}, args),
                   "lora": make_engine(args.engine, model_path, adapters, args)}
        for name, engine in engines.items():
            print(f"starting the {name} {args.engine} engine", file=sys.stderr)
            await engine.start()
        args.vocab_size = engines["plain"].vocab_size if args.engine == "vllm" else engines["plain"].config.vocab_size
        rng = random.Random(args.seed)
        small = argparse.Namespace(**{**vars(args), "concurrency": 3})
        for engine_name, models in VARIANTS.values():  # warm-up
            await one_round(engines[engine_name], models, small, rng)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        names = list(VARIANTS)
        for r in range(args.rounds):
            for variant in names[r % len(names):] + names[: r % len(names)]:
                engine_name, models = VARIANTS[variant]
                seconds, tokens = await one_round(engines[engine_name], models, args, rng)
                rates[variant].append(tokens / seconds)
                print(f"[round {r + 1}/{args.rounds}] {variant}: {tokens} tokens in {seconds:.2f} s "
                      f"({tokens / seconds:.0f} tok/s)", file=sys.stderr)
        for engine in engines.values():
            await engine.shutdown()
    plain = statistics.median(rates["plain"])
    print(f"engine {args.engine}, preset {args.preset}, {args.concurrency} requests of "
          f"{args.input_len}+{args.output_len} tokens")
    print(f"{'variant':<12} {'tok/s per round':<34} {'median':>8} {'vs plain':>9}")
    for variant, values in rates.items():
        median = statistics.median(values)
        per_round = ", ".join(f"{v:.0f}" for v in values)
        print(f"{variant:<12} {per_round:<34} {median:>8.0f} {median / plain:>9.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from app.model_builder import PRESETS

    p.add_argument("--engine", default="torch", choices=("torch", "vllm"))
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
