"""Overload at a fixed offered rate on the torch engine, with the engine's threads at
several priorities (``engine.cpu_nice``) alternated in one run.

    python -m loadtests.overload [--nice 4,0] [--rounds 3] [--rate 50] [--duration-s 8]
        [--max-tokens 256] [--out FILE.json]

The app is the one of ``tests/integration/test_faults_under_load.py``
(``tests.fixtures.load.fault_app_args``): two ComputeWorker replicas of the tiny model (8
slots, one thread each), an admission queue of 16, two data-plane replicas; on a 2-core machine the engines, Serve's HTTP proxy, the ingress and
this load generator share the cores. Each variant starts its own application (one at a
time, in one Ray), warms it, then sends completions (distinct prompts, ``ignore_eos``) at
``--rate`` per second for ``--duration-s`` whatever the answers (the fault tests' open
loop, tests/fixtures/load.py). Printed and stored per run: requests accepted (200) and
their rate and p99 latency, requests refused (429) and their p99 latency, anything else;
then the medians by variant. Starts its own Redis and Ray; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

from loadtests.benchmark import percentile, write_report
from tests.fixtures.load import fault_app_args, open_loop

APP = "overload"


def _say(msg: str) -> None:
    print(f"[overload] {msg}", file=sys.stderr, flush=True)


def summarize(outcomes: list, offered_per_s: float, elapsed_s: float) -> dict:
    """Accepted (200) and refused (429) requests of one open loop, and their p99."""
    ok = [o.latency_s for o in outcomes if o.status == 200]
    refused = [o.latency_s for o in outcomes if o.status == 429]
    return {
        "offered_per_s": offered_per_s,
        "accepted": len(ok),
        "accepted_per_s": len(ok) / elapsed_s,
        "accepted_p99_s": _p99(ok),
        "refused": len(refused),
        "refused_p99_s": _p99(refused),
        "other": len(outcomes) - len(ok) - len(refused),
    }


def _p99(xs: list[float]) -> float | None:
    return percentile(xs, 99) if xs else None


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if unit == "ms" else f"{x:.2f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.overload")
    p.add_argument("--nice", default="4,0", help="engine.cpu_nice values to alternate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=float, default=50.0, help="requests offered per second")
    p.add_argument("--duration-s", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--queue-depth", type=int, default=16, help="router.max_queue_depth (the fault test's)")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--out", default="loadtests/results/overload.json")
    args = p.parse_args(argv)
    nices = [int(n) for n in args.nice.split(",") if n.strip()]

    import ray
    from ray import serve

    from app.builder import build_app, use_serve_process_env
    from app.cli import wait_ready
    from app.local_redis import LocalRedis
    from app.model_builder import ensure_model

    model_path = ensure_model(Path("models/tiny"), "tiny")
    base_url = f"http://127.0.0.1:{args.port}/{APP}"
    runs: list[dict] = []
    with LocalRedis() as redis:
        use_serve_process_env()  # as app.cli does
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        try:
            for rnd in range(1, args.rounds + 1):
                for nice in nices:
                    _say(f"round {rnd}/{args.rounds}: cpu_nice {nice}: deploying")
                    serve.run(build_app(fault_app_args(model_path, redis.url, args.queue_depth, cpu_nice=nice)), name=APP, route_prefix=f"/{APP}", blocking=False)
                    if not wait_ready(base_url, 600):
                        raise TimeoutError(f"{APP} not ready")
                    # One-off costs (first allocations, connections) out of the measurement.
                    asyncio.run(open_loop(base_url, 4, 2, 16))
                    time.sleep(2)
                    gc.collect()
                    gc.freeze()  # this process's own full collections out of the latencies
                    started = time.monotonic()
                    try:
                        outcomes, offered = asyncio.run(open_loop(base_url, args.rate, args.duration_s, args.max_tokens))
                    finally:
                        gc.unfreeze()
                    run = summarize(outcomes, offered, time.monotonic() - started)
                    run.update(round=rnd, cpu_nice=nice)
                    runs.append(run)
                    _say(
                        f"round {rnd} cpu_nice {nice}: offered {run['offered_per_s']:.1f}/s; accepted "
                        f"{run['accepted']} ({run['accepted_per_s']:.1f}/s, p99 {_fmt(run['accepted_p99_s'])}); "
                        f"429 {run['refused']} (p99 {_fmt(run['refused_p99_s'], 'ms')}); other {run['other']}"
                    )
                    serve.delete(APP)
        except KeyboardInterrupt:
            _say("interrupted: everything stopped")
            return 130
        finally:
            serve.shutdown()
            ray.shutdown()

    print(f"{'cpu_nice':>8}  {'accepted/s per run':>22}  {'accepted p99 s':>18}  {'429 p99 ms':>18}  other")
    for nice in nices:
        rows = [r for r in runs if r["cpu_nice"] == nice]
        acc = [r["accepted_per_s"] for r in rows]
        p99 = [r["accepted_p99_s"] or 0 for r in rows]
        rej = [1000 * (r["refused_p99_s"] or 0) for r in rows]
        print(
            f"{nice:>8}  {', '.join(f'{x:.1f}' for x in acc):>22}  {', '.join(f'{x:.1f}' for x in p99):>18}  "
            f"{', '.join(f'{x:.0f}' for x in rej):>18}  {sum(r['other'] for r in rows)}"
        )
        print(
            f"{'median':>8}  {statistics.median(acc):>22.1f}  {statistics.median(p99):>18.2f}  {statistics.median(rej):>18.0f}"
        )
    _say(f"stored {write_report(args.out, {'args': vars(args), 'runs': runs})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
