"""Scoring a text's log-likelihood, what evaluation harnesses send (lm-evaluation-harness's
``local-completions``: the prompt's token ids, ``echo``, ``logprobs: 1``, ``max_tokens:
1``, greedy, not streamed), against our app with the vLLM engine and against plain
``vllm serve`` on the same weights and engine options, alternated (loadtests/compare_vllm.py
starts and stops each in turn, never both at once).

    python -m loadtests.scoring_vs_vllm [--rounds 2] [--concurrency 1,8] [--input-len 256]

Each level is a closed loop of ``concurrency`` requests in flight, ``--prompts-per-slot``
x concurrency requests (at least ``--min-prompts``), random prompts of ``--input-len``
ids drawn with a fixed seed (the same for both systems). Every scoring reply is checked:
one logprob per prompt token (the first null) and one for the generated token. Each
level runs two kinds of request back to back (``--kinds``): ``score`` (the above) and
``plain`` (the same prompts, ``max_tokens: 1``, no echo or logprobs), so the ratio of
the two ratios separates what scoring costs from what any one-token request costs in
front of vLLM. Prints per level requests/s, scored prompt tokens/s and latency p50/p90,
and the median ratios ours/vllm of requests/s and of p50 latency per kind; stores the
JSON in ``--out``. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.benchmark import add_ingress_option, percentile, write_report
from loadtests.compare_vllm import MODEL_NAME, OurApp, VLLMServer, add_load_options, alternate, prepare, vllm_flags


def _say(msg: str) -> None:
    print(f"[scoring_vs_vllm] {msg}", file=sys.stderr, flush=True)


def request_body(kind: str, ids: list[int]) -> dict:
    if kind == "plain":
        return {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0}
    return {"model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}


async def score_level(base_url: str, concurrency: int, prompts: list[list[int]], warmup: int, kind: str) -> dict:
    """Send every prompt's request of ``kind``, ``concurrency`` at a time; their latencies."""
    latencies: list[float] = []
    queue = list(prompts)

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def one(ids: list[int], keep: bool) -> None:
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=request_body(kind, ids))
            elapsed = time.perf_counter() - started
            if r.status_code != 200:
                raise RuntimeError(f"{kind} request failed: {r.status_code} {r.text[:300]}")
            if keep:
                latencies.append(elapsed)
            if kind == "plain":
                return
            lp = r.json()["choices"][0]["logprobs"]
            values = lp["token_logprobs"]
            if len(values) != len(ids) + 1 or values[0] is not None or any(v is None for v in values[1:]):
                raise RuntimeError(f"a reply without the prompt's logprobs: {len(values)} for {len(ids)} ids")

        async def worker(keep: bool, items: list) -> None:
            while items:
                await one(items.pop(), keep)

        warm = [queue[i % len(queue)] for i in range(warmup)]
        await asyncio.gather(*(worker(False, warm) for _ in range(concurrency)))
        started = time.perf_counter()
        await asyncio.gather(*(worker(True, queue) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    scored = sum(len(p) for p in prompts)
    return {
        "kind": kind,
        "concurrency": concurrency,
        "requests": len(prompts),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(prompts) / wall, 3),
        "scored_tokens_per_s": round(scored / wall, 1),
        "p50_latency_ms": round(1000 * percentile(latencies, 50), 1),
        "p90_latency_ms": round(1000 * percentile(latencies, 90), 1),
    }


def measure(base_url: str, system: str, rnd: int, args) -> list[dict]:
    levels = []
    for c in args.concurrency:
        n = max(args.min_prompts, args.prompts_per_slot * c)
        rng = random.Random(args.seed + c)
        prompts = [[rng.randrange(10, args.vocab_size) for _ in range(args.input_len)] for _ in range(n)]
        for kind in args.kinds:
            _say(f"round {rnd}: {system} concurrency {c}, {n} {kind} requests of {args.input_len} ids")
            level = asyncio.run(score_level(base_url, c, prompts, warmup=min(c, 8), kind=kind))
            level.update(system=system, round=rnd, loadavg=[round(x, 2) for x in os.getloadavg()])
            _say(f"  {level['requests_per_s']} req/s, p50 {level['p50_latency_ms']} ms")
            levels.append(level)
    return levels


def ratios(levels: list[dict], concurrencies: list[int], kinds: list[str]) -> dict:
    def med(system: str, c: int, kind: str, key: str):
        vals = [lv[key] for lv in levels if lv["system"] == system and lv["concurrency"] == c and lv["kind"] == kind]
        return statistics.median(vals) if vals else None

    out = {}
    for kind in kinds:
        for c in concurrencies:
            row = {}
            for key in ("requests_per_s", "p50_latency_ms"):
                ours, theirs = med("ours", c, kind, key), med("vllm", c, kind, key)
                row.update({f"ours_{key}": ours, f"vllm_{key}": theirs,
                            f"{key}_ours_over_vllm": round(ours / theirs, 3) if ours and theirs else None})
            out[f"{kind} c{c}"] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.scoring_vs_vllm")
    add_load_options(p)
    add_ingress_option(p)
    p.set_defaults(concurrency="1,8", input_len=256, output_len=1)
    p.add_argument("--kinds", default="score,plain", help="comma-separated: score, plain")
    p.add_argument("--out", default="loadtests/results/scoring_vs_vllm.json")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k.strip()]
    if not set(args.kinds) <= {"score", "plain"}:
        p.error("--kinds takes score and plain")
    args.with_worker = None  # the config's default layout
    model_path = prepare(args)
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.gettempdir()) / f"scoring_vllm_server_{os.getpid()}.log"
    flags = vllm_flags(model_path, args)
    systems = [("ours", OurApp(model_path, args, args.port)), ("vllm", VLLMServer(flags, args.port, log_path))]
    _say(f"vllm flags: {' '.join(flags)} (server log: {log_path})")
    try:
        levels, startups = alternate(systems, base_url, args, _say, measure_fn=measure)
    except KeyboardInterrupt:
        _say("interrupted: everything stopped")
        return 130
    table = ratios(levels, args.concurrency, args.kinds)
    print(f"{'system':>6} {'kind':>6} {'c':>3} {'round':>5} {'req/s':>8} {'tok/s':>9} {'p50 ms':>8} {'p90 ms':>8}")
    for lv in levels:
        print(f"{lv['system']:>6} {lv['kind']:>6} {lv['concurrency']:>3} {lv['round']:>5} {lv['requests_per_s']:>8} "
              f"{lv['scored_tokens_per_s']:>9} {lv['p50_latency_ms']:>8} {lv['p90_latency_ms']:>8}")
    for name, r in table.items():
        print(f"{name}: req/s ours/vllm {r['requests_per_s_ours_over_vllm']}, "
              f"p50 latency ours/vllm {r['p50_latency_ms_ours_over_vllm']}")
    result = {"args": vars(args), "vllm_command": systems[1][1].cmd, "startups": startups, "levels": levels,
              "ratios": table}
    _say(f"stored {write_report(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
