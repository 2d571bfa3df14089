"""Tests of the benchmark client in loadtests/benchmark.py.

Pure parts (``summarize``, ``percentile``, ``compare``, ``SSEParser``) are checked with exact
values on hand-made inputs; ``run_level`` is checked end to end against a small fake
OpenAI SSE server started here on a free loopback port (a test of the client only).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.benchmark import (  # noqa: E402
    RequestRecord,
    SSEParser,
    compare,
    fetch_first_model,
    format_table,
    percentile,
    read_vocab_size,
    run_level,
    store_results,
    summarize,
)

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


# --------------------------------------------------------------------------------------
# summarize
# --------------------------------------------------------------------------------------


def _records() -> list[RequestRecord]:
    return [
        # 3 tokens in 3 chunks: ttft 100 ms, e2e 400 ms, tpot (400-100)/2 = 150, ITL 100, 200
        RequestRecord(ok=True, start=0.0, ttft=0.1, chunk_times=[0.1, 0.2, 0.4],
                      output_tokens=3, prompt_tokens=10, end=0.4),
        # usage says 4 tokens in 2 chunks: ttft 300, e2e 500, tpot (500-300)/3, ITL 100
        RequestRecord(ok=True, start=1.0, ttft=0.3, chunk_times=[1.3, 1.4],
                      output_tokens=4, prompt_tokens=20, end=1.5),
        # 1 token: ttft 200, e2e 200, no TPOT, no ITL
        RequestRecord(ok=True, start=0.0, ttft=0.2, chunk_times=[0.2],
                      output_tokens=1, prompt_tokens=30, end=0.2),
        # failure: its times must not enter any figure
        RequestRecord(ok=False, error="HTTP 500: boom", start=2.0, ttft=5.0,
                      chunk_times=[7.0, 9.0], output_tokens=100, prompt_tokens=1000, end=12.0),
    ]


def test_summarize_counts_and_throughput():
    s = summarize(_records(), duration_s=2.0)
    assert s["num_requests"] == 4
    assert s["completed"] == 3
    assert s["failed"] == 1
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["total_input_tokens"] == 60
    assert s["total_output_tokens"] == 8
    assert s["request_throughput"] == approx(1.5)
    assert s["output_throughput"] == approx(4.0)
    assert s["total_token_throughput"] == approx(34.0)
    assert s["goodput"] is None and s["good_requests"] is None


def test_summarize_ttft_e2e_percentiles():
    s = summarize(_records(), duration_s=2.0)
    # TTFT ms sorted: 100, 200, 300 -> p90 at rank 1.8 = 280, p99 at rank 1.98 = 298
    assert s["mean_ttft_ms"] == approx(200.0)
    assert s["p50_ttft_ms"] == approx(200.0)
    assert s["p90_ttft_ms"] == approx(280.0)
    assert s["p99_ttft_ms"] == approx(298.0)
    assert s["std_ttft_ms"] == approx(math.sqrt(20000 / 3))
    # E2E ms sorted: 200, 400, 500
    assert s["mean_e2el_ms"] == approx(1100 / 3)
    assert s["p50_e2el_ms"] == approx(400.0)
    assert s["p90_e2el_ms"] == approx(480.0)
    assert s["p99_e2el_ms"] == approx(498.0)


def test_summarize_tpot_and_itl_definitions():
    s = summarize(_records(), duration_s=2.0)
    # TPOT only for requests with > 1 token, using usage tokens (not the chunk count)
    tpots = [150.0, 200.0 / 3]
    assert s["mean_tpot_ms"] == approx(sum(tpots) / 2)
    assert s["p50_tpot_ms"] == approx(sum(tpots) / 2)
    assert s["p99_tpot_ms"] == approx(200 / 3 + 0.99 * (150 - 200 / 3))
    # ITL: each gap between text chunks, pooled: 100, 200, 100 (failure's 2000 excluded)
    assert s["mean_itl_ms"] == approx(400 / 3)
    assert s["p50_itl_ms"] == approx(100.0)
    assert s["p90_itl_ms"] == approx(180.0)
    assert s["p99_itl_ms"] == approx(198.0)


def test_summarize_goodput_with_slos():
    recs = _records()
    # TTFT SLO 250 ms: requests with TTFT 100 and 200 meet it
    s = summarize(recs, duration_s=2.0, slo_ttft_ms=250)
    assert s["good_requests"] == 2
    assert s["goodput"] == approx(1.0)
    # TPOT SLO 100 ms: 66.7 meets, 150 does not, the 1-token request counts as TPOT 0
    s = summarize(recs, duration_s=2.0, slo_tpot_ms=100)
    assert s["good_requests"] == 2
    # both: only the 1-token request (TTFT 200, TPOT 0) meets both
    s = summarize(recs, duration_s=4.0, slo_ttft_ms=250, slo_tpot_ms=100)
    assert s["good_requests"] == 1
    assert s["goodput"] == approx(0.25)
    assert s["slo_ttft_ms"] == 250 and s["slo_tpot_ms"] == 100
    # the SLO bound is inclusive
    s = summarize(recs, duration_s=1.0, slo_ttft_ms=100)
    assert s["good_requests"] == 1


def test_summarize_all_failed_and_error_cap():
    recs = [RequestRecord(ok=False, error=f"e{i}", start=0, end=1) for i in range(8)]
    s = summarize(recs, duration_s=1.0, slo_ttft_ms=100)
    assert s["completed"] == 0 and s["failed"] == 8
    assert s["errors"] == ["e0", "e1", "e2", "e3", "e4"]
    assert s["p50_ttft_ms"] is None and s["mean_e2el_ms"] is None
    assert s["request_throughput"] == 0.0
    assert s["goodput"] == 0.0
    with pytest.raises(ValueError):
        summarize(recs, duration_s=0.0)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    import random

    rng = random.Random(1)
    for n in (1, 2, 5, 17, 100):
        xs = [rng.uniform(0, 50) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_compare_ratios():
    a = {"request_throughput": 2.0, "output_throughput": 100.0, "p50_ttft_ms": 50.0,
         "goodput": None, "p99_tpot_ms": 0.0}
    b = {"request_throughput": 3.0, "output_throughput": 150.0, "p50_ttft_ms": 25.0,
         "goodput": 1.0, "p99_tpot_ms": 5.0}
    r = compare(a, b)
    assert r["request_throughput"] == approx(1.5)
    assert r["output_throughput"] == approx(1.5)
    assert r["p50_ttft_ms"] == approx(0.5)
    assert r["goodput"] is None  # missing on one side
    assert r["p99_tpot_ms"] is None  # zero denominator
    assert r["mean_e2el_ms"] is None  # absent from both


def test_format_table_and_store(tmp_path):
    s = summarize(_records(), duration_s=2.0)
    s["label"] = "c=4"
    table = format_table([s])
    lines = table.splitlines()
    assert lines[0].startswith("level") and "TTFT p50/p99 ms" in lines[0]
    assert lines[2].startswith("c=4")
    assert "200.0/298.0" in lines[2]
    assert len({len(l) for l in lines}) == 1  # aligned
    out = tmp_path / "sub" / "r.json"
    store_results(out, {"label": "a", "levels": [s]})
    store_results(out, {"label": "b", "levels": [s]})
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["a", "b"]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError):
        store_results(bad, {"label": "c"})


def test_read_vocab_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert read_vocab_size(tmp_path) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError):
        read_vocab_size(tmp_path)


# --------------------------------------------------------------------------------------
# SSE parsing
# --------------------------------------------------------------------------------------

RECORDED = (
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"Hel"}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"l\xc3\xa9"}]}\n\n'
    b"event: message\n"
    b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    '{"id":"cmpl-1","choices":[{"index":0,"text":"Hel"}]}',
    '{"id":"cmpl-1","choices":[{"index":0,"text":"l\u00e9"}]}',
    '{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}',
    "[DONE]",
]


def _parse_in_pieces(data: bytes, cuts: list[int]) -> list[str]:
    p = SSEParser()
    out: list[str] = []
    prev = 0
    for c in cuts + [len(data)]:
        out += p.feed(data[prev:c])
        prev = c
    return out + p.flush()


def test_sse_whole_stream():
    assert _parse_in_pieces(RECORDED, []) == EXPECTED


def test_sse_split_at_every_byte_boundary():
    for cut in range(1, len(RECORDED)):
        assert _parse_in_pieces(RECORDED, [cut]) == EXPECTED, cut
    # byte by byte (also splits the 2-byte UTF-8 character)
    assert _parse_in_pieces(RECORDED, list(range(1, len(RECORDED)))) == EXPECTED


def test_sse_crlf_and_cr_line_endings():
    crlf = RECORDED.replace(b"\n", b"\r\n")
    for cut in range(1, len(crlf)):
        assert _parse_in_pieces(crlf, [cut]) == EXPECTED, cut
    cr = RECORDED.replace(b"\n", b"\r")
    assert _parse_in_pieces(cr, []) == EXPECTED
    # a CRLF split between CR and LF inside a multi-line event is one line end, not two
    multi = b"data: a\r\ndata: b\r\n\r\n"
    for cut in range(1, len(multi)):
        assert _parse_in_pieces(multi, [cut]) == ["a\nb"], cut


def test_sse_multiline_data_and_unterminated_tail():
    p = SSEParser()
    assert p.feed(b"data: a\ndata:b\n\ndata: tail") == ["a\nb"]
    assert p.flush() == ["tail"]
    assert p.flush() == []


def test_sse_event_not_emitted_before_blank_line():
    p = SSEParser()
    assert p.feed(b'data: {"x":1}\n') == []
    assert p.feed(b"\n") == ['{"x":1}']


# --------------------------------------------------------------------------------------
# run_level against a fake OpenAI SSE server
# --------------------------------------------------------------------------------------

FIRST_TOKEN_DELAY_S = 0.03
CHUNK_GAP_S = 0.004


class FakeServer:
    """Streams ceil(max_tokens/2) text chunks (2 tokens per chunk) and a usage chunk."""

    def __init__(self, fail_requests: tuple[int, ...] = (), cut_requests: tuple[int, ...] = ()):
        self.fail_requests = set(fail_requests)
        self.cut_requests = set(cut_requests)
        self.payloads: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.payloads)
        self.payloads.append(body)
        self.headers.append(dict(request.headers))
        if n in self.fail_requests:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}},
                                     status=500)
        chat = request.path.endswith("/chat/completions")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            max_tokens = body["max_tokens"]
            sent = 0
            # an empty first chunk (role only) must not count as the first token
            first = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]} if chat else \
                {"choices": [{"index": 0, "text": ""}]}
            await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
            while sent < max_tokens:
                k = min(2, max_tokens - sent)
                sent += k
                text = "ab"[:k]
                choice = {"index": 0, "delta": {"content": text}} if chat else \
                    {"index": 0, "text": text}
                line = b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
                half = len(line) // 2
                await resp.write(line[:half])  # split mid-line
                await asyncio.sleep(CHUNK_GAP_S / 2)
                await resp.write(line[half:])
                await asyncio.sleep(CHUNK_GAP_S / 2)
                if n in self.cut_requests:
                    return resp  # stream ends without usage and [DONE]
            prompt = body.get("prompt")
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 7,
                     "completion_tokens": max_tokens,
                     "total_tokens": 0}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@pytest_asyncio.fixture
async def fake_server():
    srv = FakeServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest.mark.asyncio
async def test_run_level_closed_loop_end_to_end():
    srv = FakeServer()
    await srv.start()
    try:
        recs: list[RequestRecord] = []
        res = await run_level(
            srv.base_url, "fake-model", concurrency=3, num_prompts=10,
            input_len=16, output_len=5, vocab_size=50, seed=3, warmup=2,
            api_key="sk-test", progress=False, on_record=recs.append,
        )
    finally:
        await srv.stop()
    assert res["completed"] == 10 and res["failed"] == 0 and res["errors"] == []
    assert res["concurrency"] == 3 and res["num_prompts"] == 10
    assert len(srv.payloads) == 12  # 2 warmup + 10 measured
    assert srv.max_in_flight == 3  # closed loop: exactly C in flight
    for p in srv.payloads:
        assert p["model"] == "fake-model"
        assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
        assert p["ignore_eos"] is True and p["max_tokens"] == 5 and p["temperature"] == 0.0
        assert len(p["prompt"]) == 16
        assert all(isinstance(t, int) and 10 <= t < 50 for t in p["prompt"])
    assert all(h.get("Authorization") == "Bearer sk-test" for h in srv.headers)
    # warmup and measured prompts differ
    assert len({tuple(p["prompt"]) for p in srv.payloads}) == 12
    # output tokens come from usage (5), not from the 3 chunks
    assert res["total_output_tokens"] == 50
    assert res["total_input_tokens"] == 160
    assert len(recs) == 10
    for r in recs:
        assert r.ok and r.output_tokens == 5 and len(r.chunk_times) == 3
        assert FIRST_TOKEN_DELAY_S * 0.9 <= r.ttft < r.latency
    assert res["mean_ttft_ms"] < res["mean_e2el_ms"]
    assert res["p50_ttft_ms"] >= FIRST_TOKEN_DELAY_S * 1000 * 0.9
    assert res["p50_itl_ms"] > 0 and res["p50_tpot_ms"] > 0
    assert res["request_throughput"] == pytest.approx(10 / res["duration_s"])


@pytest.mark.asyncio
async def test_run_level_same_seed_same_prompts(fake_server):
    a = await run_level(fake_server.base_url, "m", 2, 4, input_len=8, output_len=1,
                        seed=11, progress=False)
    b = await run_level(fake_server.base_url, "m", 2, 4, input_len=8, output_len=1,
                        seed=11, progress=False)
    prompts = sorted(tuple(p["prompt"]) for p in fake_server.payloads)
    assert prompts[0::2] == prompts[1::2]  # each prompt sent once per run
    assert a["completed"] == b["completed"] == 4
    assert a["p50_tpot_ms"] is None  # 1 token: no TPOT


@pytest.mark.asyncio
async def test_run_level_counts_failures_and_keeps_errors():
    srv = FakeServer(fail_requests=(1,), cut_requests=(4,))
    await srv.start()
    try:
        res = await run_level(srv.base_url, "fake-model", 2, 8, input_len=4, output_len=4,
                              progress=False, slo_ttft_ms=10_000)
    finally:
        await srv.stop()
    assert res["completed"] == 6 and res["failed"] == 2
    assert any(e.startswith("HTTP 500") and "boom" in e for e in res["errors"])
    assert any("[DONE]" in e for e in res["errors"])
    assert res["total_output_tokens"] == 24  # failures excluded
    assert res["good_requests"] == 6


@pytest.mark.asyncio
async def test_run_level_chat_poisson_and_model_listing(fake_server):
    model = await fetch_first_model(fake_server.base_url)
    assert model == "fake-model"
    res = await run_level(fake_server.base_url, model, None, 6, endpoint="chat",
                          request_rate=200.0, input_len=12, output_len=3, progress=False)
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["request_rate"] == 200.0
    assert res["total_output_tokens"] == 18
    for p in fake_server.payloads:
        msgs = p["messages"]
        assert msgs[0]["role"] == "user" and len(msgs[0]["content"].split()) == 12
        assert "prompt" not in p and p["ignore_eos"] is True
    assert res["p50_ttft_ms"] < res["p50_e2el_ms"]


@pytest.mark.asyncio
async def test_run_level_connection_refused_is_failure():
    # a port nobody listens on: bind, read the port, close
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = await run_level(f"http://127.0.0.1:{port}", "m", 2, 3, input_len=2, output_len=2,
                          progress=False, timeout_s=5)
    assert res["completed"] == 0 and res["failed"] == 3
    assert res["errors"] and "Connect" in res["errors"][0]


@pytest.mark.asyncio
async def test_run_level_in_a_child_process(fake_server):
    """compare_vllm.run_level_in_child (the --paired modes' load generator): the same
    level from a spawned process, its CPU seconds, and a failure raised here."""
    from loadtests.compare_vllm import run_level_in_child

    load = dict(base_url=fake_server.base_url, model="fake-model", concurrency=2, num_prompts=6,
                input_len=8, output_len=5, vocab_size=50, seed=5, progress=False)
    level, cpu_s = await asyncio.to_thread(run_level_in_child, load, 120)
    assert level["completed"] == 6 and level["failed"] == 0 and level["total_output_tokens"] == 30
    assert len(fake_server.payloads) == 6 and fake_server.max_in_flight == 2
    assert 0 < cpu_s < 60
    with pytest.raises(RuntimeError, match="num_prompts"):
        await asyncio.to_thread(run_level_in_child, {**load, "num_prompts": 0}, 120)


def test_cpu_roles_of_a_data_plane_benchmarks_processes():
    import os

    from loadtests.benchmark import cpu_role

    assert cpu_role(os.getpid(), "python -m loadtests.dataplane_throughput") == "this process"
    assert cpu_role(1, "/usr/bin/redis-server 127.0.0.1:6379") == "redis"
    assert cpu_role(1, "redis-aof-rewrite 127.0.0.1:6379") == "redis"
    assert cpu_role(1, "ray::ServeReplica:dpbench:DataPlane") == "data plane"
    assert cpu_role(1, "/x/site-packages/ray/core/src/ray/raylet/raylet --node") == "ray"
    assert cpu_role(1, "ray::ServeController") == "ray"
    assert cpu_role(1, "/usr/sbin/sshd -D") == "other"


def test_cpu_meter_counts_this_process_and_children_that_exited():
    """CPU spent here and by a child that ran and exited between start and stop, per
    GB of the bytes given."""
    import subprocess
    import sys
    import time

    from loadtests.benchmark import CpuMeter

    meter = CpuMeter().start()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"], check=True)
    seconds = meter.stop()
    assert seconds["this process"] >= 0.25
    assert seconds["child"] >= 0.25
    per_gb = meter.per_gb(500_000_000)
    assert per_gb["this process"] == seconds["this process"] * 2
    assert abs(per_gb["total"] - 2 * sum(seconds.values())) < 1e-9
