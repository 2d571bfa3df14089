"""What a stream's pacing costs at its end: requests that stop on a token against requests
of the same prompts and the same number of tokens that reach ``max_tokens``, alternated.

    python -m loadtests.stream_end [--engine vllm|torch] [--concurrency 1,8,32]
        [--rounds 2] [--output-len 64] [--out FILE.json]

The ComputeWorker sends a stream's tokens on at most every ``engine.stream_interval_ms``
(longer with many streams: ``stream_max_messages_per_s``), so that they coalesce. A request
due to reach ``max_tokens`` has long had its last wait cut to its projected end; one that
ends on EOS or a stop (most chat replies) waited out the rest of its interval until the
engine said when a request's last delta is ready (``Engine.end_signal``, 2026-12-06).

On the tiny checkpoint (built if missing), our app (data plane off, as
``loadtests.compare_vllm`` runs it) gets, per prompt, one greedy calibration request
(``return_token_ids``); the end ``n`` is the first position from ``output_len / 2`` on
whose token has not come before. Then, alternated request by request at each
concurrency (closed loop, streamed): ``length``, ``max_tokens = n``; ``stop``, the same
prompt with that token in ``stop_token_ids`` and ``max_tokens = 4 n`` (far enough that
the worker's projection of a length end never cuts its wait). Both
generate the same ``n`` tokens (checked from each stream's usage). Reported per level:
the median time to the end of the stream of each kind, and stop / length (1.0: the end
costs nothing). Loopback only; Ray is shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from loadtests.benchmark import write_report
from loadtests.compare_vllm import MODEL_NAME, OurApp, add_load_options, prepare


def _say(msg: str) -> None:
    print(f"[stream_end] {msg}", file=sys.stderr, flush=True)


async def _stream(session, url: str, body: dict) -> tuple[float, int]:
    """Seconds to the end of one streamed completion, and its completion tokens."""
    started = time.perf_counter()
    tokens = -1
    async with session.post(url, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return time.perf_counter() - started, tokens


async def calibrate(session, url: str, prompts: list[list[int]], output_len: int) -> list[tuple[list[int], int, int]]:
    """(prompt, n, stop token) per prompt that has a token new to its greedy reply at or
    after ``output_len // 2``."""
    pairs = []
    for prompt in prompts:
        async with session.post(url, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }) as r:
            reply = await r.json()
        ids = reply["choices"][0]["token_ids"]
        for i in range(output_len // 2, len(ids)):
            if ids[i] not in ids[:i]:
                pairs.append((prompt, i + 1, ids[i]))
                break
    return pairs


async def level(session, url: str, pairs, concurrency: int, num_requests: int) -> dict:
    """Closed loop at ``concurrency``, kinds alternated request by request."""
    times: dict[str, list[float]] = {"length": [], "stop": []}
    jobs = []
    for k in range(num_requests):
        prompt, n, stop_id = pairs[(k // 2) % len(pairs)]
        body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
        if k % 2 == 0:
            jobs.append(("length", n, body | {"max_tokens": n}))
        else:
            jobs.append(("stop", n, body | {"max_tokens": 4 * n, "stop_token_ids": [stop_id]}))
    queue = iter(jobs)

    async def client():
        for kind, n, body in queue:
            seconds, tokens = await _stream(session, url, body)
            if tokens != n:
                raise RuntimeError(f"{kind}: {tokens} completion tokens, expected {n}")
            times[kind].append(seconds)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    out = {f"{kind}_ms_p50": 1000 * statistics.median(t) for kind, t in times.items()}
    out["stop_over_length"] = out["stop_ms_p50"] / out["length_ms_p50"]
    return out


async def run(base_url: str, args) -> list[dict]:
    import aiohttp

    url = f"{base_url}/v1/completions"
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab_size) for _ in range(args.input_len)] for _ in range(16)]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        pairs = await calibrate(session, url, prompts, args.output_len)
        if not pairs:
            raise RuntimeError("no prompt's reply had a new token in its second half")
        _say(f"{len(pairs)} prompts; ends at {sorted(n for _, n, _ in pairs)} tokens")
        await level(session, url, pairs, 2, 8)  # warm-up, not counted
        results = []
        for rnd in range(args.rounds):
            for c in args.concurrency:
                n = max(args.min_prompts, args.prompts_per_slot * c) * 2
                row = {"round": rnd + 1, "concurrency": c, **await level(session, url, pairs, c, n)}
                _say(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
                results.append(row)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.stream_end")
    add_load_options(p)
    p.add_argument("--engine", choices=("vllm", "torch"), default="vllm")
    p.add_argument("--out", default="loadtests/results/stream_end.json")
    args = p.parse_args(argv)
    args.ingress = "serve-proxy"
    model_path = prepare(args)
    app = OurApp(model_path, args, args.port)  # compare_vllm's app: the vLLM engine
    if args.engine == "torch":
        engine = app.app_args["engine"]
        app.app_args["engine"] = {k: v for k, v in engine.items() if k != "vllm"} | {"name": "torch"}
    try:
        _say(f"starting our app ({args.engine} engine) in {app.start(args.start_timeout_s):.0f}s")
        results = asyncio.run(run(f"http://127.0.0.1:{args.port}", args))
    finally:
        app.stop()
    summary = {
        c: {
            key: statistics.median(r[key] for r in results if r["concurrency"] == c)
            for key in ("length_ms_p50", "stop_ms_p50", "stop_over_length")
        }
        for c in args.concurrency
    }
    print(json.dumps({"levels": results, "medians": summary}, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'levels': results, 'medians': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
