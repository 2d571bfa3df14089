"""What a session turn costs during a sessions-Redis outage with and without the copy on
the session's next owner (``dataplane.outage_backup_timeout_s``), and with Redis up for
reference. Two DataPlane applications of two replicas each (copies on, copies off) on one
redis-server of its own, driven through their Serve handles as the ingress drives them,
alternated call by call: ``append_turn`` latency (p50, p90) on sessions created while
Redis was up, then with Redis stopped.

    python -m loadtests.outage_backup [--turns 200] [--rounds 2] [--out FILE]

Starts its own Ray and redis-server; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid

from loadtests.benchmark import write_report


def _say(msg: str) -> None:
    print(f"[outage-backup] {msg}", file=sys.stderr, flush=True)


def _args(url: str, backup_timeout_s: float) -> dict:
    return {
        "dataplane": {
            "num_replicas": 2,
            "num_cpus": 0.1,
            "outage_backup_timeout_s": backup_timeout_s,
            "redis": {
                "url": url, "password_env": None, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5,
                "reconnect_interval_s": 0.2,
            },
        }
    }


def _summary(v: list[float]) -> dict:
    v = sorted(v)
    return {"p50_ms": 1000 * statistics.median(v), "p90_ms": 1000 * v[int(0.9 * (len(v) - 1))], "n": len(v)}


async def _turns(handles: dict, sessions: dict, versions: dict, n: int) -> dict[str, list[float]]:
    """``n`` turns per application, alternated, each on the next of its sessions."""
    out: dict[str, list[float]] = {name: [] for name in handles}
    for i in range(n):
        for name, h in handles.items():
            sid = sessions[name][i % len(sessions[name])]
            t = time.perf_counter()
            rec = await h.append_turn.remote(
                "bench", sid, versions[sid], [{"role": "user", "content": "x" * 200}], 50, turn_id=uuid.uuid4().hex, shard_key=sid
            )
            out[name].append(time.perf_counter() - t)
            versions[sid] = rec.version
    return out


async def _wait(handles: dict, degraded: bool, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [await h.status.remote(shard_key=str(k)) for h in handles.values() for k in range(8)]
        if all(s["degraded"] == degraded for s in states) and (degraded or all(s["unsynced_sessions"] == 0 for s in states)):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the data planes did not reach degraded={degraded} within {timeout_s}s")


async def run(turns: int, rounds: int) -> dict:
    import ray
    from ray import serve

    from app.builder import use_serve_process_env
    from app.config import AppConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.deployment import dataplane_deployment
    from deployments.dataplane.types import new_session_id

    use_serve_process_env()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    report: dict = {"turns": turns, "rounds": []}
    with LocalRedis() as server:
        handles = {}
        for name, timeout in (("copies_on", 1.0), ("copies_off", 0.0)):
            config = AppConfig.model_validate(_args(server.url, timeout))
            app = dataplane_deployment(config).bind(config.model_dump(mode="json"))
            handles[name] = serve.run(app, name=f"dp_{name}", route_prefix=None)
        _say("two data planes of 2 replicas each are up")
        for r in range(rounds):
            sessions = {name: [new_session_id() for _ in range(16)] for name in handles}
            versions = {}
            for name, h in handles.items():
                for sid in sessions[name]:
                    await h.create_session.remote("bench", session_id=sid, shard_key=sid)
                    versions[sid] = 0
            up = await _turns(handles, sessions, versions, turns)
            _say(f"round {r + 1}: {turns} turns each with Redis up")
            server.stop()
            try:
                # Each replica notices on its next call or ping; measure after that.
                await _turns(handles, sessions, versions, 4)
                await _wait(handles, True)
                down = await _turns(handles, sessions, versions, turns)
                _say(f"round {r + 1}: {turns} turns each with Redis down")
            finally:
                server.start()
            await _wait(handles, False, 60)
            row = {f"{name}_{phase}": _summary(v[name]) for phase, v in (("up", up), ("down", down)) for name in handles}
            row["down_on_over_off_p50"] = row["copies_on_down"]["p50_ms"] / row["copies_off_down"]["p50_ms"]
            report["rounds"].append(row)
            _say(
                "round {}: p50 ms, Redis up on/off {:.2f}/{:.2f}, down on/off {:.2f}/{:.2f}".format(
                    r + 1, row["copies_on_up"]["p50_ms"], row["copies_off_up"]["p50_ms"],
                    row["copies_on_down"]["p50_ms"], row["copies_off_down"]["p50_ms"],
                )
            )
        serve.shutdown()
    ray.shutdown()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.outage_backup")
    p.add_argument("--turns", type=int, default=200, help="turns per application, phase and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="loadtests/results/outage_backup.json")
    a = p.parse_args(argv)
    report = asyncio.run(run(a.turns, a.rounds))
    path = write_report(a.out, report)
    for i, row in enumerate(report["rounds"], 1):
        print(
            f"round {i}: append_turn p50/p90 ms  Redis up: copies on {row['copies_on_up']['p50_ms']:.2f}/{row['copies_on_up']['p90_ms']:.2f}"
            f"  off {row['copies_off_up']['p50_ms']:.2f}/{row['copies_off_up']['p90_ms']:.2f}"
            f"  |  Redis down: on {row['copies_on_down']['p50_ms']:.2f}/{row['copies_on_down']['p90_ms']:.2f}"
            f"  off {row['copies_off_down']['p50_ms']:.2f}/{row['copies_off_down']['p90_ms']:.2f}"
            f"  (on/off p50 {row['down_on_over_off_p50']:.2f})"
        )
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
