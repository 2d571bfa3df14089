"""Placement benchmark: cache-aware placement (session affinity + prefix index) versus plain
power-of-two-choices, on a multi-turn chat workload over two ComputeWorker replicas,
alternated in one run.

    python -m loadtests.placement [--preset small] [--sessions 6] [--turns 6] [--rounds 2]

Each mode deploys the same application (torch engine, data plane with KV reuse on, two
workers) with only ``router.placement.policy`` changed: ``cache_aware`` or ``p2c``. Then
``--sessions`` conversations run at once, each a server-side session (X-Session-Id) of
``--turns`` turns with ``--think-s`` between them; every turn sends one new user message
of ``--turn-words`` words and asks for ``--reply-tokens`` tokens, so a conversation's
context grows by about (turn + reply) tokens per turn.

Reported per mode, from the workers' own KV counters (each replica's routing stats, read
from the replica actors before and after):

* ``hit_rate``: prompt tokens whose KV was reused (from the worker's L1 or from the data
  plane) / all prompt tokens;
* ``l1_hit_rate``: prompt tokens reused from the worker's own L1 / all prompt tokens;
* TTFT p50/p99 (client-side, streamed) over all turns and over turns >= 2 (turn 1 has
  nothing to reuse in either mode).

Texts differ per mode and round (seeded), so no mode reuses another's blocks. Starts its
own Redis and Ray; needs the ``redis-server`` binary.
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

import httpx

from loadtests.benchmark import percentile, write_report
from loadtests.multiturn import WORDS, wait_ready

APP = "placement-bench"
MODES = ("cache_aware", "p2c")


def _say(msg: str) -> None:
    print(f"[placement] {msg}", file=sys.stderr, flush=True)


def app_args(model_path: Path, redis_url: str, policy: str, args) -> dict:
    return {
        "model": {"id": "bench", "path": str(model_path)},
        "engine": {"name": "torch", "num_threads": args.num_threads, "max_num_seqs": 8},
        "compute": {"num_replicas": 2, "num_cpus": 1},
        "router": {"max_batch_size": 1, "placement": {"policy": policy}},
        "limits": {"default_max_tokens": 64},
        "dataplane": {"enabled": True, "kv_reuse": True, "num_replicas": 2, "redis": {"url": redis_url}},
    }


def replica_stats(app: str = APP) -> dict[str, dict]:
    """Routing stats (with the KV counters) of every live ComputeWorker replica of the
    Serve application ``app``, by actor name."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#ComputeWorker#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    refs = {n: ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names}
    return {n: ray.get(ref, timeout=60) for n, ref in refs.items()}


def wait_for_replicas(n: int, timeout_s: float = 300, app: str = APP) -> dict[str, dict]:
    """The stats of ``app``'s ComputeWorker replicas once there are ``n``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats(app)
        if len(stats) == n:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(stats)} of {n} ComputeWorker replicas after {timeout_s}s")
        time.sleep(1.0)


async def ttft_of_turn(client: httpx.AsyncClient, sid: str, text: str, reply_tokens: int) -> float:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": reply_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("no content in the stream")
    return ttft


async def conversation(client: httpx.AsyncClient, args, seed: int) -> list[float]:
    rng = random.Random(seed)
    sid = (await client.post("/v1/sessions")).json()["id"]
    # Sessions start spread over the first think time, as users do.
    await asyncio.sleep(rng.uniform(0, args.think_s))
    ttfts = []
    for _ in range(args.turns):
        text = " ".join(rng.choice(WORDS) for _ in range(args.turn_words))
        ttfts.append(await ttft_of_turn(client, sid, text, args.reply_tokens))
        await asyncio.sleep(args.think_s * rng.uniform(0.7, 1.3))
    await client.delete(f"/v1/sessions/{sid}")
    return ttfts


async def workload(base_url: str, args, seed: int) -> list[list[float]]:
    limits = httpx.Limits(max_connections=args.sessions + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(conversation(client, args, seed + i) for i in range(args.sessions)))


def kv_delta(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Sum over replicas of the KV counters' growth, plus requests per replica."""
    total: dict[str, int] = {}
    per_replica = []
    for name, st in after.items():
        b = before.get(name, {})
        per_replica.append(st["num_requests"] - b.get("num_requests", 0))
        for key, value in st["kv"].items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value - b.get("kv", {}).get(key, 0)
    total["requests_per_replica"] = sorted(per_replica)
    return total


def summarize(runs: list[list[list[float]]], kv: list[dict]) -> dict:
    all_ttft = [t for run in runs for conv in run for t in conv]
    later = [t for run in runs for conv in run for t in conv[1:]]
    reused = sum(k["prefix_hit_tokens"] for k in kv)
    computed = sum(k["prefilled_tokens"] for k in kv)
    l1 = sum(k.get("l1_hit_tokens", 0) for k in kv)
    total = reused + computed
    return {
        "turns": len(all_ttft),
        "hit_rate": reused / total if total else 0.0,
        "l1_hit_rate": l1 / total if total else 0.0,
        "prompt_tokens": total,
        "reused_tokens": reused,
        "l1_reused_tokens": l1,
        "ttft_p50_ms": 1000 * percentile(all_ttft, 50),
        "ttft_p99_ms": 1000 * percentile(all_ttft, 99),
        "ttft_turns_ge2_p50_ms": 1000 * percentile(later, 50),
        "ttft_turns_ge2_p99_ms": 1000 * percentile(later, 99),
        "ttft_mean_ms": 1000 * statistics.fmean(all_ttft),
    }


def format_table(summary: dict[str, dict]) -> str:
    rows = [
        ("cache hit rate (reused / prompt tokens)", "hit_rate", "{:.1%}"),
        ("  of which from the worker's L1", "l1_hit_rate", "{:.1%}"),
        ("TTFT p50, all turns (ms)", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p99, all turns (ms)", "ttft_p99_ms", "{:.0f}"),
        ("TTFT p50, turns >= 2 (ms)", "ttft_turns_ge2_p50_ms", "{:.0f}"),
        ("TTFT p99, turns >= 2 (ms)", "ttft_turns_ge2_p99_ms", "{:.0f}"),
        ("turns measured", "turns", "{}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'cache_aware':>12}  {'p2c':>12}"]
    for label, key, fmt in rows:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{fmt.format(summary[m][key]):>12}" for m in MODES))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.placement")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--sessions", type=int, default=6, help="conversations at once")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-words", type=int, default=60, help="words per user turn (~3 tokens each)")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--think-s", type=float, default=1.0, help="pause between turns")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--out", default="loadtests/results/placement.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.builder import build_app
    from app.local_redis import LocalRedis
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(args.model_dir or f"models/{args.preset}"), args.preset)
    base_url = f"http://127.0.0.1:{args.port}"
    runs: dict[str, list] = {m: [] for m in MODES}
    kv: dict[str, list[dict]] = {m: [] for m in MODES}
    with LocalRedis() as redis:
        from app.builder import use_serve_process_env

        use_serve_process_env()  # as app.cli does
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        try:
            for rnd in range(args.rounds):
                # Alternate which mode goes first, so drift hits both alike.
                for mode in MODES if rnd % 2 == 0 else tuple(reversed(MODES)):
                    _say(f"round {rnd + 1}/{args.rounds}: {mode}: deploying")
                    serve.run(
                        build_app(app_args(model_path, redis.url, mode, args)),
                        name=APP,
                        route_prefix="/",
                        blocking=False,
                    )
                    wait_ready(base_url)
                    before = wait_for_replicas(2)
                    seed = 10_000 * (rnd + 1) + 1000 * MODES.index(mode)
                    started = time.monotonic()
                    result = asyncio.run(workload(base_url, args, seed))
                    elapsed = time.monotonic() - started
                    after = replica_stats()
                    runs[mode].append(result)
                    kv[mode].append(kv_delta(before, after))
                    s = summarize([result], [kv[mode][-1]])
                    _say(
                        f"  {mode}: {s['turns']} turns in {elapsed:.0f}s, hit rate {s['hit_rate']:.1%} "
                        f"(L1 {s['l1_hit_rate']:.1%}), TTFT p50 {s['ttft_p50_ms']:.0f} ms "
                        f"p99 {s['ttft_p99_ms']:.0f} ms; KV {kv[mode][-1]}"
                    )
                    serve.delete(APP)
        finally:
            serve.shutdown()
            ray.shutdown()

    summary = {m: summarize(runs[m], kv[m]) for m in MODES}
    ratios = {
        "ttft_p50_p2c_over_cache_aware": summary["p2c"]["ttft_p50_ms"] / summary["cache_aware"]["ttft_p50_ms"],
        "ttft_p99_p2c_over_cache_aware": summary["p2c"]["ttft_p99_ms"] / summary["cache_aware"]["ttft_p99_ms"],
        "ttft_turns_ge2_p50_p2c_over_cache_aware": summary["p2c"]["ttft_turns_ge2_p50_ms"]
        / summary["cache_aware"]["ttft_turns_ge2_p50_ms"],
    }
    print(format_table(summary))
    print(json.dumps(ratios, indent=2))
    report = {"args": vars(args), "summary": summary, "ratios": ratios, "kv_counters": kv, "raw_ttft_s": runs}
    _say(f"stored {write_report(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
