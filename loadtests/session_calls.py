"""What a session turn's data-plane calls cost the ingress, sent straight to the owner
replica or through Serve's router (``dataplane.direct_calls``), side by side in one Ray.

    python -m loadtests.session_calls [--preset small] [--conversations 30] [--turns 3]

Two copies of the app, ``direct`` (``dataplane.direct_calls: true``, the default) and
``through_serve`` (false), the same but for that, each with its own ingress and data
plane. Conversations of ``--turns`` short turns (a session each: created, read and
appended at every turn, deleted at the end; from turn 2 on the router starts the KV
lookup of the session's last turn as the request arrives) alternate between the two
apps. Per app: the time to first token of turns 1 and >= 2, and the CPU seconds each
conversation cost its Ingress replica (the ingress and its router) and its DataPlane
replicas, from /proc, per request. Medians go to stdout and to --out. Starts its own
Redis and Ray; loopback only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from loadtests.benchmark import CpuMeter, write_report
from loadtests.miss_cost import chat_ttft, deploy_side_by_side
from loadtests.multiturn import WORDS, app_args

APPS = {"direct": True, "through_serve": False}


def _say(msg: str) -> None:
    print(f"[session_calls] {msg}", file=sys.stderr, flush=True)


def _replicas_of(app: str):
    """A ``CpuMeter`` role: ``app``'s Ingress and DataPlane replicas by part, the rest
    of the machine as ``other``."""

    def role(pid: int, cmdline: str) -> str:
        if f"ServeReplica:{app}:Ingress" in cmdline:
            return "ingress"
        if f"ServeReplica:{app}:DataPlane" in cmdline:
            return "dataplane"
        return "other"

    return role


def conversation(client: httpx.Client, app: str, turns: int, rng: random.Random) -> list[float]:
    """TTFT (s) of each turn of one session conversation on ``app``."""
    sid = client.post(f"/{app}/v1/sessions").json()["id"]
    ttfts = []
    for _ in range(turns):
        text = " ".join(rng.choice(WORDS) for _ in range(25))
        ttfts.append(chat_ttft(client, app, text, {"X-Session-Id": sid}, max_tokens=4))
    r = client.delete(f"/{app}/v1/sessions/{sid}")
    if r.status_code != 200:
        raise RuntimeError(f"{app}: delete {r.status_code} {r.text[:200]}")
    return ttfts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.session_calls")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--conversations", type=int, default=30, help="measured conversations per app")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--port", type=int, default=8126)
    p.add_argument("--out", default="loadtests/results/session_calls.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.builder import use_serve_process_env
    from app.local_redis import LocalRedis
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(f"models/{args.preset}"), args.preset)
    ttft_first: dict[str, list[float]] = {a: [] for a in APPS}
    ttft_later: dict[str, list[float]] = {a: [] for a in APPS}
    cpu: dict[str, dict[str, list[float]]] = {a: {"ingress": [], "dataplane": []} for a in APPS}
    with LocalRedis() as redis:
        use_serve_process_env()  # as app.cli does
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        apps = {name: app_args(model_path, redis.url, True, num_threads=2, l1=False, direct_calls=direct)
                for name, direct in APPS.items()}
        deploy_side_by_side(apps, args.port, _say)
        rng = random.Random(1)
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as client:
            for name in APPS:  # warm every path first (connections, the handles' routers)
                for _ in range(3):
                    conversation(client, name, args.turns, rng)
            for i in range(args.conversations):
                for name in (APPS if i % 2 == 0 else list(APPS)[::-1]):
                    time.sleep(0.3)
                    meter = CpuMeter(_replicas_of(name)).start()
                    ttfts = conversation(client, name, args.turns, rng)
                    used = meter.stop()
                    ttft_first[name].append(1000 * ttfts[0])
                    ttft_later[name].extend(1000 * t for t in ttfts[1:])
                    for part in ("ingress", "dataplane"):
                        # Per request: the turns, and the session's create and delete.
                        cpu[name][part].append(1000 * used.get(part, 0.0) / (args.turns + 2))
                if (i + 1) % 10 == 0:
                    _say(f"{i + 1}/{args.conversations} conversations per app")
        serve.shutdown()
        ray.shutdown()
    results = {
        name: {
            "ttft_turn1_ms": statistics.median(ttft_first[name]),
            "ttft_later_turns_ms": statistics.median(ttft_later[name]),
            "ingress_cpu_ms_per_request": statistics.mean(cpu[name]["ingress"]),
            "dataplane_cpu_ms_per_request": statistics.mean(cpu[name]["dataplane"]),
        }
        for name in APPS
    }
    d, s = results["direct"], results["through_serve"]
    ratios = {f"direct_over_through_serve/{k}": d[k] / s[k] for k in d}
    for name, r in results.items():
        print(f"{name:14s} " + "  ".join(f"{k} {v:6.2f}" for k, v in r.items()))
    print(json.dumps(ratios, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'results': results, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
