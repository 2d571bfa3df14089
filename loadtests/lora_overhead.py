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
import sys
import tempfile
from pathlib import Path

from loadtests.sampling_overhead import add_batch_args, alternate, one_round, print_table

VARIANTS = {
    "plain": ("plain", [None]),
    "lora:base": ("lora", [None]),
    "lora:one": ("lora", ["r8"]),
    "lora:mixed": ("lora", [None, "r8", "r16"]),
}


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
            await one_round(engines[engine_name], small, rng, tag="warm-up", loras=models)

        async def run(variant: str) -> tuple[float, int]:
            engine_name, models = VARIANTS[variant]
            return await one_round(engines[engine_name], args, rng, tag="r", loras=models)

        rates = await alternate(list(VARIANTS), args.rounds, run)
        for engine in engines.values():
            await engine.shutdown()
    print(f"engine {args.engine}, preset {args.preset}, {args.concurrency} requests of "
          f"{args.input_len}+{args.output_len} tokens")
    print_table(rates, per_round_width=34)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="torch", choices=("torch", "vllm"))
    add_batch_args(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
