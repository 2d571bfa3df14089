"""The gRPC API against the REST API of the same running service: streamed completions
at each concurrency, the two alternated round by round (each round starting with the other
one), output tokens/s and TTFT (the first chunk with text) per API, and gRPC / REST.

    python -m loadtests.grpc_vs_rest [--rounds 3] [--concurrency 1,8] [--requests 16]
        [--output-len 64] [--start | --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000]

``--start`` (the default without ``--url``) starts the service as the README does
(``app.cli run`` with serve_config.yaml; the torch engine and the tiny model, the ports
moved to free ones) and stops it afterwards. Loopback only. What it answers: what the
gRPC path costs or saves against REST. Each RPC goes through the REST route in the
ingress (app/grpc_api/service.py), so the difference is the proxies (Serve's gRPC proxy
against its HTTP one) and the gRPC layer's JSON translation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from app.local_redis import _free_port
from loadtests.benchmark import write_report

APIS = ("rest", "grpc")


def _say(msg: str) -> None:
    print(f"[grpc-vs-rest] {msg}", file=sys.stderr, flush=True)


def _body(i: int, output_len: int) -> dict:
    # Distinct prompts (no prefix shared between requests), fixed length, all tokens.
    return {"model": "tiny-llama", "prompt": [10 + (i * 7 + k) % 900 for k in range(32)],
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True}


async def _rest_one(client, body: dict) -> tuple[float, int]:
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens


async def _grpc_one(stub, body: dict) -> tuple[float, int]:
    from google.protobuf import struct_pb2

    from app.grpc_api import llm_pb2 as pb

    extra = struct_pb2.Struct()
    extra.update({"ignore_eos": True})
    request = pb.CompletionRequest(model=body["model"], prompt_token_ids=body["prompt"], max_tokens=body["max_tokens"],
                                   temperature=0, extra=extra)
    started = time.perf_counter()
    ttft, tokens = None, 0
    async for chunk in stub.CompletionStream(request):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - started
        if chunk.HasField("usage"):
            tokens = chunk.usage.completion_tokens
    return ttft, tokens


async def measure(api: str, url: str, grpc_target: str, concurrency: int, n: int, output_len: int, offset: int) -> dict:
    import grpc
    import httpx

    from app.grpc_api import llm_pb2_grpc

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client, \
            grpc.aio.insecure_channel(grpc_target) as channel:
        stub = llm_pb2_grpc.LLMStub(channel)

        async def one(i: int):
            async with sem:
                body = _body(offset + i, output_len)
                return await (_rest_one(client, body) if api == "rest" else _grpc_one(stub, body))

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - started
    ttfts = [t for t, _ in results if t is not None]
    return {
        "api": api,
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": sum(k for _, k in results),
        "output_tput": sum(k for _, k in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
    }


def start_service(tmp: str) -> tuple[subprocess.Popen, str, str]:
    http_port, grpc_port = _free_port(), _free_port()
    doc = yaml.safe_load(Path("serve_config.yaml").read_text())
    doc["http_options"]["port"] = http_port
    doc["grpc_options"]["port"] = grpc_port
    config = Path(tmp) / "serve_config.yaml"
    config.write_text(yaml.safe_dump(doc))
    _say(f"starting the service (HTTP {http_port}, gRPC {grpc_port}; torch engine, tiny model)")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--config", str(config), "--state-dir", tmp],
                            start_new_session=True)
    url = f"http://127.0.0.1:{http_port}"
    from app.cli import wait_ready

    if not wait_ready(url, 600):
        stop_service(proc)
        raise SystemExit("the service did not become ready")
    return proc, url, f"127.0.0.1:{grpc_port}"


def stop_service(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"], capture_output=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.grpc_vs_rest")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="per API, level and round")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--url", help="a running service's HTTP base URL (else --start)")
    p.add_argument("--grpc", help="its gRPC address, host:port")
    p.add_argument("--out", default="loadtests/results/grpc_vs_rest.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        if args.url:
            url, target = args.url, args.grpc or "127.0.0.1:9000"
        else:
            proc, url, target = start_service(tmp)
        rows = []
        try:
            asyncio.run(measure("rest", url, target, 2, 4, 8, 10_000))  # warm-up, not counted
            asyncio.run(measure("grpc", url, target, 2, 4, 8, 10_000))
            for rnd in range(1, args.rounds + 1):
                order = APIS if rnd % 2 else APIS[::-1]
                for c in levels:
                    for api in order:
                        row = asyncio.run(measure(api, url, target, c, args.requests, args.output_len, 1000 * rnd + 100 * c))
                        row["round"] = rnd
                        rows.append(row)
                        _say(f"round {rnd} c={c} {api}: {row['output_tput']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms")
        finally:
            if proc is not None:
                stop_service(proc)
    ratios = {}
    for c in levels:
        per = {}
        for rnd in range(1, args.rounds + 1):
            got = {r["api"]: r for r in rows if r["round"] == rnd and r["concurrency"] == c}
            per.setdefault("tput", []).append(got["grpc"]["output_tput"] / got["rest"]["output_tput"])
            per.setdefault("ttft", []).append(got["grpc"]["ttft_p50_ms"] / got["rest"]["ttft_p50_ms"])
        ratios[f"c{c}"] = {
            "grpc_over_rest_output_tput": statistics.median(per["tput"]),
            "grpc_over_rest_ttft_p50": statistics.median(per["ttft"]),
            "per_round_tput": per["tput"],
            "per_round_ttft": per["ttft"],
        }
    print(json.dumps(ratios, indent=2))
    _say(f"stored {write_report(args.out, {'rows': rows, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
