"""What a tenant's rate-limit check adds to a request (``security.rate_limits``,
app/rate_limits.py): the latency of ``RateLimiter.acquire`` (one Lua script on a local
redis-server, both limits on) beside a plain ``PING`` on the same client, and of the
refund that follows each request off its path.

    python -m loadtests.rate_limit_check [--calls 3000] [--rounds 3]

Prints p50/p90/p99 in ms per round, alternating the two, and the median ratio of
acquire's p50 to PING's (what the script costs beyond a round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from app.config import RateLimitsConfig, RedisConfig
from app.local_redis import LocalRedis
from app.rate_limits import RateLimiter


def _pcts(ts: list[float]) -> tuple[float, float, float]:
    ts = sorted(ts)
    return tuple(1000 * ts[min(len(ts) - 1, int(len(ts) * q))] for q in (0.5, 0.9, 0.99))


async def _round(rl: RateLimiter, calls: int) -> dict:
    ping, acquire, refund = [], [], []
    for i in range(calls):
        t = time.perf_counter()
        await rl._client.ping()
        ping.append(time.perf_counter() - t)
        t = time.perf_counter()
        grant = await rl.acquire("bench", 100)
        acquire.append(time.perf_counter() - t)
        t = time.perf_counter()
        await rl.refund(grant, 50)
        refund.append(time.perf_counter() - t)
        if (i + 1) % 1000 == 0:
            print(f"  {i + 1}/{calls}", file=sys.stderr)
    return {"ping": _pcts(ping), "acquire": _pcts(acquire), "refund": _pcts(refund)}


async def main_async(args) -> None:
    redis = LocalRedis().start()
    try:
        # Limits no run reaches: every call is admitted and charged.
        config = RateLimitsConfig(requests_per_minute=10**9, tokens_per_minute=10**12)
        rl = RateLimiter(config, RedisConfig(url=redis.url))
        await _round(rl, 200)  # warm-up: connections, the script loaded
        ratios = []
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            got = await _round(rl, args.calls)
            for name, (p50, p90, p99) in got.items():
                print(f"round {r + 1} {name:8s} ms p50 {p50:.3f} p90 {p90:.3f} p99 {p99:.3f}")
            ratios.append(got["acquire"][0] / got["ping"][0])
        print(f"acquire p50 / PING p50, median of rounds: {statistics.median(ratios):.2f}")
        await rl.close()
    finally:
        redis.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
