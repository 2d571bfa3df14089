"""Side-by-side measurements for the serving path, in one run on one machine.

    python -m loadtests.compare_serving [--preset small] [--rounds 2] [--out FILE.json]
        [--configs batched,router_unbatched,unbatched] [--skip-direct]

It starts a local Ray, and in each round (configurations alternate, so drift on a shared
machine hits all of them alike):

* deploys the app with batching on (router ``max_batch_size`` 8, engine ``max_num_seqs``
  32) and measures concurrency 32 and concurrency 1;
* redeploys with router batching off (``max_batch_size`` 1; the engine still batches
  continuously) and measures concurrency 32;
* redeploys with batching off everywhere (router 1, engine ``max_num_seqs`` 1) and measures
  concurrency 32;
* shuts Serve down and calls the same engine class in-process at concurrency 1 (the
  serving overhead's baseline).

It prints and stores the ratios: output tokens/s at concurrency 32 with batching on versus
off, and p50 end-to-end latency at concurrency 1 through the service versus in-process.
Odd rounds deploy in reverse order.

``--configs`` picks the deployments (default the three above). ``batched_malloc`` is
"batched" with the engine's KV arena off (``engine.kv_arena_bytes`` 0): with
``--configs batched,batched_malloc --skip-direct`` a run is an A/B of the arena on the
serving path (ratios ``output_tput_c32_arena_over_malloc`` and ``..._c1_...``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from loadtests.benchmark import RequestRecord, compare, format_table, run_level, summarize, write_report

CONFIGS = {
    "batched": {"router": {"max_batch_size": 8}, "engine": {"max_num_seqs": 32}},
    "router_unbatched": {"router": {"max_batch_size": 1}, "engine": {"max_num_seqs": 32}},
    "unbatched": {"router": {"max_batch_size": 1}, "engine": {"max_num_seqs": 1}},
    # As "batched", with the engine's KV buffers from malloc instead of its KV arena
    # (engine.kv_arena_bytes 0): the arena's cost or gain on this path (--configs).
    "batched_malloc": {"router": {"max_batch_size": 8}, "engine": {"max_num_seqs": 32, "kv_arena_bytes": 0}},
}
DEFAULT_CONFIGS = ("batched", "router_unbatched", "unbatched")


def _say(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def app_args(model_path: Path, num_threads: int, overrides: dict) -> dict:
    return {
        "model": {"id": "bench", "path": str(model_path)},
        "engine": {"name": "torch", "num_threads": num_threads, **overrides.get("engine", {})},
        "compute": {"num_replicas": 1, "num_cpus": 1},
        "router": {"batch_wait_timeout_ms": 5, "max_queue_depth": 1024, **overrides.get("router", {})},
        "limits": {"default_max_tokens": 64},
        # Serving path only: the direct engine saves no KV either (the data plane's cost
        # and gain are measured by loadtests.multiturn).
        "dataplane": {"enabled": False},
    }


def wait_ready(base_url: str, timeout_s: float = 600) -> None:
    from app.cli import wait_ready as poll_ready

    if not poll_ready(base_url, timeout_s):
        raise TimeoutError(f"{base_url} not ready after {timeout_s}s")


async def direct_engine_level(model_path: Path, num_threads: int, args) -> dict:
    """Concurrency 1 against the engine class in this process: no HTTP, no Serve."""
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams
    from deployments.compute.engines.torch_engine import TorchEngine

    from app.config import EngineConfig

    # As the deployed "batched" worker: the config's KV arena.
    engine = TorchEngine(
        str(model_path), max_num_seqs=32, num_threads=num_threads, kv_arena_bytes=EngineConfig().kv_arena_bytes
    )
    await engine.start()
    rng = random.Random(args.seed + 1000)
    records = []

    async def one(i: int, measured: bool):
        prompt = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        req = GenerationRequest(
            f"direct-{i}",
            prompt,
            SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
        )
        rec = RequestRecord(ok=True, start=time.perf_counter())
        async for delta in engine.generate(req):
            now = time.perf_counter()
            if delta.text or delta.token_ids:
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                rec.chunk_times.append(now)
            rec.output_tokens = delta.num_output_tokens
        rec.prompt_tokens = len(prompt)
        rec.end = time.perf_counter()
        if measured:
            records.append(rec)

    for i in range(2):
        await one(-i - 1, measured=False)
    started = time.perf_counter()
    for i in range(args.num_prompts_c1):
        await one(i, measured=True)
    duration = time.perf_counter() - started
    await engine.shutdown()
    return {"label": "direct_engine", "concurrency": 1, **summarize(records, duration)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compare_serving")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--model-dir", default=None, help="default: models/<preset>")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts-c32", type=int, default=96)
    p.add_argument("--num-prompts-c1", type=int, default=12)
    p.add_argument("--num-threads", type=int, default=2, help="torch threads of the engine")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtests/results/compare_serving.json")
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"which deployments to measure each round, in this order (of {', '.join(CONFIGS)}); "
        "the ratios need the default three, batched_malloc is compared with batched",
    )
    p.add_argument(
        "--skip-direct", action="store_true", help="no in-process engine level (no service-over-direct ratios)"
    )
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown or 'empty'}; choose from {', '.join(CONFIGS)}")

    import ray
    from ray import serve

    from app.builder import build_app
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(args.model_dir or f"models/{args.preset}"), args.preset)
    args.vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    base_url = f"http://127.0.0.1:{args.port}"
    from app.builder import use_serve_process_env

    use_serve_process_env()  # as app.cli does
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results: dict[str, list[dict]] = {}

    async def level(label: str, concurrency: int, num_prompts: int) -> None:
        _say(f"{label}: concurrency {concurrency}, {num_prompts} requests")
        r = await run_level(
            base_url, "bench", concurrency, num_prompts, input_len=args.input_len,
            output_len=args.output_len, vocab_size=args.vocab_size, warmup=min(concurrency, 8),
            seed=args.seed, label=label, progress=False,
        )
        results.setdefault(f"{label}@c{concurrency}", []).append(r)

    for rnd in range(args.rounds):
        # Odd rounds go in reverse order, so neither of two compared deployments always
        # runs right after a fresh Ray start or right before the in-process engine.
        for name in configs if rnd % 2 == 0 else configs[::-1]:
            overrides = CONFIGS[name]
            _say(f"round {rnd + 1}/{args.rounds}: deploying '{name}'")
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            serve.run(build_app(app_args(model_path, args.num_threads, overrides)), name="bench", route_prefix="/", blocking=False)
            wait_ready(base_url)
            asyncio.run(level(name, 32, args.num_prompts_c32))
            if name in ("batched", "batched_malloc"):
                asyncio.run(level(name, 1, args.num_prompts_c1))
            serve.shutdown()
        if args.skip_direct:
            continue
        _say(f"round {rnd + 1}/{args.rounds}: direct in-process engine")
        results.setdefault("direct_engine@c1", []).append(
            asyncio.run(direct_engine_level(model_path, args.num_threads, args))
        )
    ray.shutdown()

    def median_of(key: str, stat: str) -> float:
        return statistics.median(r[stat] for r in results[key])

    def ratio(num: tuple[str, str], den: tuple[str, str]) -> Optional[float]:
        if num[0] not in results or den[0] not in results:
            return None  # a configuration left out by --configs
        return median_of(*num) / median_of(*den)

    tput = "output_throughput"
    ratios = {
        "output_tput_c32_batched_over_unbatched": ratio(("batched@c32", tput), ("unbatched@c32", tput)),
        "output_tput_c32_batched_over_router_unbatched": ratio(
            ("batched@c32", tput), ("router_unbatched@c32", tput)
        ),
        "p50_e2e_c1_service_over_direct": ratio(("batched@c1", "p50_e2el_ms"), ("direct_engine@c1", "p50_e2el_ms")),
        "p50_ttft_c1_service_over_direct": ratio(("batched@c1", "p50_ttft_ms"), ("direct_engine@c1", "p50_ttft_ms")),
        # The KV arena (batched) against malloc (batched_malloc), both in this run.
        "output_tput_c32_arena_over_malloc": ratio(("batched@c32", tput), ("batched_malloc@c32", tput)),
        "output_tput_c1_arena_over_malloc": ratio(("batched@c1", tput), ("batched_malloc@c1", tput)),
    }
    if "batched@c1" in results and "direct_engine@c1" in results:
        ratios["service_minus_direct_p50_e2e_ms"] = median_of("batched@c1", "p50_e2el_ms") - median_of(
            "direct_engine@c1", "p50_e2el_ms"
        )
    ratios = {k: v for k, v in ratios.items() if v is not None}
    print(format_table([r for runs in results.values() for r in runs]))
    print(json.dumps(ratios, indent=2))
    if "unbatched@c32" in results and "batched@c32" in results:
        print(json.dumps(compare(results["unbatched@c32"][0], results["batched@c32"][0]), indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'results': results, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
