"""Our app with the vLLM engine in several variants, alternated in one run: stream pacing
and where the front end runs. What ``compare_vllm`` cannot show, since its gap to plain
vLLM moves by tens of percent between minutes on a shared machine.

    python -m loadtests.vllm_variants [--variants 15:500,0:0,15:500:pin,15:500:apart] [--rounds 2]
        [--concurrency 8,32] [--prompts-per-slot 24] [--out FILE.json]

A variant is ``INTERVAL_MS:MAX_MESSAGES_PER_S`` (``engine.stream_interval_ms`` and
``engine.stream_max_messages_per_s``), with ``:pin`` to move every process of the Ray
session (and this one, the load) off the cores vLLM's CPU build binds its forward pass
to, while the variant runs. vLLM's CPU build binds the forward's OpenMP threads to all
cores but the ones it reserves (one on this 2-core VM) and leaves its scheduler and
frontend free to run anywhere; ``:pin`` asks whether keeping our front end off the
forward's core pays. The layout is the app's default for one vLLM replica (the ingress and
its worker in one process, ``ingress.with_worker``, app/server.py); ``:apart`` runs the
ingress and its worker as two deployments (``with_worker: false``), ``:with_worker`` says
the default outright. ``:dataplane`` turns the data plane on (off in the others, as in
``compare_vllm``): sessions and vLLM's KV connector (docs/vllm_kv.md) against a
redis-server this run starts, so the variant pays what the default config pays per request
(the connector's lookup) and per filled block (its save); the prompts are random, so every
lookup misses. Each variant starts its own Ray and application (as
``compare_vllm`` does, behind ``--ingress``, HAProxy by default here), runs each
concurrency level (completions, 128-token prompts, 64 output tokens, streaming), and stops
them; variants alternate within each round. Printed and stored per level: output tokens/s,
TTFT/ITL/TPOT p50 and CPU ms per 1000 output tokens by process role. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import psutil

from loadtests.benchmark import add_ingress_option, run_level, write_report
from loadtests.compare_vllm import MODEL_NAME, OurApp, measure


def _say(msg: str) -> None:
    print(f"[vllm_variants] {msg}", file=sys.stderr, flush=True)


VARIANT_FLAGS = ("pin", "with_worker", "apart", "dataplane")


def parse_variant(text: str) -> dict:
    parts = text.split(":")
    flags = parts[2:]
    if (
        len(parts) < 2
        or any(f not in VARIANT_FLAGS for f in flags)
        or len(set(flags)) != len(flags)
        or {"with_worker", "apart"} <= set(flags)
    ):
        raise ValueError(f"a variant is INTERVAL_MS:MAX_MESSAGES_PER_S[:pin][:with_worker|:apart][:dataplane], not {text!r}")
    return {
        "name": text,
        "interval_ms": float(parts[0]),
        "max_messages_per_s": float(parts[1]),
        "pin": "pin" in flags,
        "dataplane": "dataplane" in flags,
        # None: the config's default layout.
        "with_worker": True if "with_worker" in flags else False if "apart" in flags else None,
    }


def _forward_pids() -> set[int]:
    return {
        p.pid for p in psutil.process_iter(["cmdline"]) if "VLLM::Worker" in " ".join(p.info["cmdline"] or [])
    }


def _session_pids() -> set[int]:
    """This process and every descendant of the Ray processes it started (raylet, GCS and
    the workers, replicas and vLLM's processes under them)."""
    from loadtests.paired import descendants

    return {os.getpid(), *descendants()}


def _set_affinity(pids: set[int], cpus: set[int]) -> int:
    """Every thread of ``pids`` onto ``cpus``; how many threads were moved."""
    moved = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                moved += 1
            except OSError:
                pass  # gone, or not ours to move
    return moved


def pin_front_end() -> dict:
    """Move the session's processes but vLLM's forward off the forward's cores."""
    forward = _forward_pids()
    forward_cpus: set[int] = set()
    for pid in forward:
        try:
            forward_cpus |= set(os.sched_getaffinity(pid))
        except OSError:
            pass
    rest = set(range(os.cpu_count() or 1)) - forward_cpus
    if not forward or not rest:
        return {"pinned_threads": 0, "forward_cpus": sorted(forward_cpus), "front_end_cpus": []}
    moved = _set_affinity(_session_pids() - forward, rest)
    return {"pinned_threads": moved, "forward_cpus": sorted(forward_cpus), "front_end_cpus": sorted(rest)}


def unpin() -> None:
    _set_affinity(_session_pids(), set(range(os.cpu_count() or 1)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.vllm_variants")
    p.add_argument("--model-dir", default="models/tiny")
    p.add_argument("--variants", default="15:500,0:0,15:500:pin")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--prompts-per-slot", type=int, default=24, help="requests per level = this x c")
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-gib", type=float, default=1.0)
    add_ingress_option(p, default="haproxy")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtests/results/vllm_variants.json")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]

    from app.model_builder import ensure_model

    model_path = ensure_model(Path(args.model_dir), "tiny")
    args.vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    base_url = f"http://127.0.0.1:{args.port}"
    levels: list[dict] = []
    pins: list[dict] = []
    redis = None
    if any(v["dataplane"] for v in variants):
        from app.local_redis import LocalRedis

        redis = LocalRedis().start()
        _say(f"redis-server for the :dataplane variants at {redis.url}")
    try:
        for rnd in range(1, args.rounds + 1):
            for variant in variants:
                args.stream_max_messages_per_s = variant["max_messages_per_s"]
                app = OurApp(model_path, args, args.port)
                app.app_args["engine"]["stream_interval_ms"] = variant["interval_ms"]
                if variant["with_worker"] is not None:
                    app.app_args["ingress"]["with_worker"] = variant["with_worker"]
                if variant["dataplane"]:
                    app.app_args["dataplane"] = {"enabled": True, "redis": {"url": redis.url, "password_env": None}}
                _say(f"round {rnd}/{args.rounds}: starting {variant['name']}")
                try:
                    app.start(args.start_timeout_s)
                    # The first requests pay one-off costs (compilation, first allocations).
                    asyncio.run(run_level(base_url, MODEL_NAME, 8, 32, warmup=8, progress=False))
                    if variant["pin"]:
                        pins.append({"round": rnd, **pin_front_end()})
                        _say(f"pinned: {pins[-1]}")
                    # compare_vllm's levels, with the variant's name as the system's.
                    levels += measure(base_url, variant["name"], rnd, args)
                finally:
                    app.stop()
                    if variant["pin"]:
                        unpin()
    except KeyboardInterrupt:
        _say("interrupted: everything stopped")
        return 130
    finally:
        if redis is not None:
            redis.cleanup()

    print(f"{'variant':>16} {'c':>3}  {'tok/s per round':>22}  {'median':>7}  {'TTFT p50':>8}  {'ITL p50':>7}  "
          f"{'ours CPU ms/1k':>14}")
    for variant in variants:
        for c in args.concurrency:
            rows = [lv for lv in levels if lv["system"] == variant["name"] and lv["concurrency"] == c]
            if not rows:
                continue
            tput = [lv.get("output_throughput") or 0 for lv in rows]
            ours = statistics.median(
                sum(v for r, v in lv["cpu_ms_per_1k_output_tokens"].items() if r.startswith("our ")) for lv in rows
            )
            print(
                f"{variant['name']:>16} {c:>3}  {', '.join(f'{t:.0f}' for t in tput):>22}  "
                f"{statistics.median(tput):>7.0f}  {statistics.median(lv.get('p50_ttft_ms') or 0 for lv in rows):>8.1f}  "
                f"{statistics.median(lv.get('p50_itl_ms') or 0 for lv in rows):>7.1f}  {ours:>14.0f}"
            )
    _say(f"stored {write_report(args.out, {'args': vars(args), 'variants': variants, 'pins': pins, 'levels': levels})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
