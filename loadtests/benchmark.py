"""Serving benchmark for the OpenAI-compatible API, reporting what ``vllm bench serve`` reports.

Run against a live server (see ``loadtests/README.md``)::

    python -m loadtests.benchmark --concurrency 1,8,32 --input-len 128 --output-len 64 \
        --out loadtests/results/bench.json --label baseline

Every request is streamed (``stream: true`` with ``stream_options.include_usage``) and timed
on the client:

* **TTFT**  time from sending the request to the first SSE chunk whose text is non-empty;
* **TPOT**  per request, ``(e2e - ttft) / (output_tokens - 1)`` (requests with > 1 token);
* **ITL**   every gap between two consecutive text-bearing chunks, pooled over requests;
* **E2E**   time from sending the request to the end of the stream (``data: [DONE]``);
* throughputs are totals over successful requests divided by the level's wall time;
* **goodput** is the number of successful requests per second that meet every SLO given
  (``--slo-ttft-ms``, ``--slo-tpot-ms``; a 1-token request counts as TPOT 0, as in vLLM).

Failed requests (HTTP error, error event, transport error, stream cut before ``[DONE]``) are
counted and their first messages kept, but excluded from every latency and throughput figure.

Library use::

    from loadtests.benchmark import run_level, compare
    a = await run_level("http://127.0.0.1:8000", "tiny-llama", concurrency=8, num_prompts=32)

The statistics (:func:`summarize`) and the SSE parsing (:class:`SSEParser`) are pure and
unit-tested in ``tests/unit/test_benchmark_stats.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
MAX_ERRORS_KEPT = 5
# Token ids below this are left out of random prompts: tokenizers put special tokens there.
MIN_TOKEN_ID = 10

__all__ = [
    "RequestRecord",
    "SSEParser",
    "summarize",
    "percentile",
    "compare",
    "run_level",
    "fetch_first_model",
    "make_token_prompt",
    "make_text_prompt",
    "build_payload",
    "read_vocab_size",
    "main",
]


# --------------------------------------------------------------------------------------
# Per-request record and statistics (pure)
# --------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What one request produced. Times are ``time.perf_counter()`` seconds.

    ``ttft`` is relative to ``start`` (``None`` when no text arrived); ``chunk_times`` are
    absolute arrival times of the text-bearing chunks; ``end`` is when the stream ended
    (or the request failed).
    """

    ok: bool
    error: Optional[str] = None
    start: float = 0.0
    ttft: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    end: float = 0.0

    @property
    def latency(self) -> float:
        return self.end - self.start


def percentile(values: Sequence[float], p: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def _pct_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}".replace(".", "_")


def _describe(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict:
    """mean/std/pXX of ``values_s`` (seconds) as ``{mean_<name>_ms: ...}``; None when empty."""
    out: dict[str, Optional[float]] = {}
    n = len(values_s)
    ms = [v * 1000.0 for v in values_s]
    out[f"mean_{name}_ms"] = sum(ms) / n if n else None
    if n:
        mean = out[f"mean_{name}_ms"]
        out[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in ms) / n)
    else:
        out[f"std_{name}_ms"] = None
    for p in percentiles:
        out[f"{_pct_key(p)}_{name}_ms"] = percentile(ms, p) if n else None
    return out


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: Optional[float] = None,
    slo_tpot_ms: Optional[float] = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """Benchmark figures over per-request records; pure (no I/O, no clock).

    Only successful requests enter latency and throughput figures. Latencies are reported
    in milliseconds (``mean_ttft_ms``, ``p50_ttft_ms``, ``p90_ttft_ms``, ``p99_ttft_ms``,
    ``std_ttft_ms`` and likewise ``tpot``, ``itl``, ``e2el``); throughputs per second.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]

    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    good = 0
    for r in ok:
        e2el = r.end - r.start
        e2els.append(e2el)
        tpot_for_slo = 0.0  # a request with <= 1 output token has no TPOT; counts as 0
        if r.ttft is not None:
            ttfts.append(r.ttft)
            if r.output_tokens > 1:
                tpot = (e2el - r.ttft) / (r.output_tokens - 1)
                tpots.append(tpot)
                tpot_for_slo = tpot
        itls.extend(b - a for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        meets = True
        if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > slo_ttft_ms):
            meets = False
        if slo_tpot_ms is not None and tpot_for_slo * 1000.0 > slo_tpot_ms:
            meets = False
        good += meets

    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    errors: list[str] = []
    for r in failed:
        if len(errors) >= MAX_ERRORS_KEPT:
            break
        errors.append(r.error or "unknown error")

    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good if has_slo else None,
        "goodput": good / duration_s if has_slo else None,
    }
    out.update(_describe("ttft", ttfts, percentiles))
    out.update(_describe("tpot", tpots, percentiles))
    out.update(_describe("itl", itls, percentiles))
    out.update(_describe("e2el", e2els, percentiles))
    return out


COMPARE_KEYS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p50_e2el_ms",
    "p99_e2el_ms",
)


def compare(a: dict, b: dict, keys: Sequence[str] = COMPARE_KEYS) -> dict:
    """Ratios ``b[k] / a[k]`` of two level summaries (as returned by :func:`run_level`).

    A throughput ratio above 1 means ``b`` is faster; a latency ratio below 1 means ``b``
    is faster. A ratio is ``None`` when either value is missing or ``a``'s is zero.
    """
    out: dict[str, Optional[float]] = {}
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if va is None or vb is None or va == 0:
            out[k] = None
        else:
            out[k] = vb / va
    return out


# --------------------------------------------------------------------------------------
# SSE parsing (pure)
# --------------------------------------------------------------------------------------


class SSEParser:
    """Incremental Server-Sent-Events parser: feed raw bytes, get ``data`` payloads.

    Bytes may be split anywhere (mid-line, mid-UTF-8 character); lines end in LF, CRLF or
    CR; ``data:`` lines of one event are joined with a newline and the event is dispatched
    on the blank line that ends it; comments (``:``) and other fields are ignored.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while True:
            i_lf = self._buf.find(b"\n")
            i_cr = self._buf.find(b"\r")
            if i_cr != -1 and (i_lf == -1 or i_cr < i_lf):
                # CR ends a line; CRLF counts once. A trailing CR may be half of a CRLF.
                if i_cr + 1 == len(self._buf):
                    break
                line = self._buf[:i_cr]
                skip = 2 if self._buf[i_cr + 1 : i_cr + 2] == b"\n" else 1
                self._buf = self._buf[i_cr + skip :]
            elif i_lf != -1:
                line = self._buf[:i_lf]
                self._buf = self._buf[i_lf + 1 :]
            else:
                break
            self._line(line, events)
        return events

    def flush(self) -> list[str]:
        """End of stream: a final line or event without its terminator is still delivered."""
        events: list[str] = []
        if self._buf:
            line = self._buf.rstrip(b"\r")
            self._buf = b""
            self._line(line, events)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if not sep:
            name, value = line, ""
        elif value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)


# --------------------------------------------------------------------------------------
# Prompts and payloads
# --------------------------------------------------------------------------------------

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


def read_vocab_size(tokenizer_dir: str | os.PathLike) -> int:
    """``vocab_size`` from ``<dir>/config.json`` (a Hugging Face checkpoint directory)."""
    path = Path(tokenizer_dir) / "config.json"
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    vocab = cfg.get("vocab_size")
    if vocab is None and isinstance(cfg.get("text_config"), dict):
        vocab = cfg["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or vocab <= MIN_TOKEN_ID:
        raise ValueError(f"{path}: no usable vocab_size (got {vocab!r})")
    return vocab


def make_token_prompt(rng: random.Random, input_len: int, vocab_size: int) -> list[int]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(input_len)]


def make_text_prompt(rng: random.Random, input_len: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, input_len)))


def build_payload(
    endpoint: str,
    model: str,
    prompt: list[int] | str,
    output_len: int,
    temperature: float,
) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if endpoint == "completions":
        payload["prompt"] = prompt
    elif endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    return payload


def _endpoint_path(endpoint: str) -> str:
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


def _chunk_text(obj: dict, endpoint: str) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0] or {}
    if endpoint == "chat":
        delta = c.get("delta") or {}
        return delta.get("content") or ""
    return c.get("text") or ""


# --------------------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------------------


def _headers(api_key: Optional[str]) -> dict:
    h = {"Accept": "text/event-stream"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


async def fetch_first_model(
    base_url: str, api_key: Optional[str] = None, timeout_s: float = 30.0
) -> str:
    """The first model id listed by ``GET /v1/models``."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with s.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {body[:300]}")
            data = json.loads(body).get("data") or []
            if not data:
                raise RuntimeError("GET /v1/models returned no models")
            return data[0]["id"]


async def _send_one(
    session: Any,
    url: str,
    payload: dict,
    endpoint: str,
    headers: dict,
    fallback_prompt_tokens: int,
) -> RequestRecord:
    """Send one streamed request; never raises (errors land in the record)."""
    rec = RequestRecord(ok=False, start=time.perf_counter())
    usage_completion: Optional[int] = None
    usage_prompt: Optional[int] = None
    done = False
    done_at: Optional[float] = None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = await resp.text()
                rec.error = f"HTTP {resp.status}: {body[:300]}"
                return rec
            parser = SSEParser()

            def handle(events: list[str], now: float) -> Optional[str]:
                nonlocal usage_completion, usage_prompt, done
                for data in events:
                    if data.strip() == "[DONE]":
                        done = True
                        return None
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        return f"bad SSE data: {data[:200]!r}"
                    if obj.get("error"):
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        return f"error event: {msg}"
                    if _chunk_text(obj, endpoint):
                        if rec.ttft is None:
                            rec.ttft = now - rec.start
                        rec.chunk_times.append(now)
                    usage = obj.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            usage_completion = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            usage_prompt = int(usage["prompt_tokens"])
                return None

            async for raw in resp.content.iter_any():
                if done:
                    continue  # drain the rest (chunked terminator) so the connection is reused
                now = time.perf_counter()
                err = handle(parser.feed(raw), now)
                if err:
                    rec.error = err
                    return rec
                if done:
                    done_at = now
            if not done:
                now = time.perf_counter()
                err = handle(parser.flush(), now)
                if err:
                    rec.error = err
                    return rec
                done_at = now
            if not done:
                rec.error = "stream ended before data: [DONE]"
                return rec
    except asyncio.TimeoutError:
        rec.error = "timeout"
        return rec
    except Exception as e:  # noqa: BLE001 - any transport error is one failed request
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    finally:
        rec.end = time.perf_counter() if done_at is None else done_at
    rec.ok = True
    rec.output_tokens = (
        usage_completion if usage_completion is not None else len(rec.chunk_times)
    )
    rec.prompt_tokens = usage_prompt if usage_prompt is not None else fallback_prompt_tokens
    return rec


class _Progress:
    def __init__(self, label: str, total: int, enabled: bool, stream=None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.failed = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.step = max(1, total // 10)

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        if not self.enabled:
            return
        msg = f"[{self.label}] {self.done}/{self.total} done"
        if self.failed:
            msg += f" ({self.failed} failed)"
        if self.tty:
            end = "\n" if self.done == self.total else ""
            print("\r" + msg, end=end, file=self.stream, flush=True)
        elif self.done % self.step == 0 or self.done == self.total:
            print(msg, file=self.stream, flush=True)


async def run_level(
    base_url: str,
    model: str,
    concurrency: Optional[int],
    num_prompts: int,
    *,
    endpoint: str = "completions",
    input_len: int = 128,
    output_len: int = 64,
    request_rate: Optional[float] = None,
    seed: int = 0,
    warmup: int = 0,
    vocab_size: int = 1000,
    temperature: float = 0.0,
    timeout_s: float = 300.0,
    api_key: Optional[str] = None,
    slo_ttft_ms: Optional[float] = None,
    slo_tpot_ms: Optional[float] = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    progress: bool = True,
    label: Optional[str] = None,
    on_record: Optional[Callable[[RequestRecord], None]] = None,
) -> dict:
    """Run one load level and return :func:`summarize`'s dict plus the level's settings.

    Closed loop (``request_rate`` None): exactly ``concurrency`` requests in flight until
    ``num_prompts`` have been sent. Open loop (``request_rate`` > 0 requests/s): Poisson
    arrivals (exponential gaps drawn with ``seed``); ``concurrency``, if not None, caps the
    requests in flight (like ``vllm bench serve --max-concurrency``).
    ``warmup`` requests are sent first (closed loop at ``concurrency``) and not measured.
    Prompts are drawn from ``random.Random(seed)``: same seed, same prompts.
    """
    import aiohttp

    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    if num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    if request_rate is None and (concurrency is None or concurrency < 1):
        raise ValueError("closed loop needs concurrency >= 1")
    if request_rate is not None and request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")

    rng = random.Random(seed)

    def make_prompt() -> list[int] | str:
        if endpoint == "completions":
            return make_token_prompt(rng, input_len, vocab_size)
        return make_text_prompt(rng, input_len)

    warm_prompts = [make_prompt() for _ in range(warmup)]
    prompts = [make_prompt() for _ in range(num_prompts)]
    url = base_url.rstrip("/") + _endpoint_path(endpoint)
    headers = _headers(api_key)
    lvl_label = label or (
        f"rate={request_rate:g}/s" if request_rate is not None else f"c={concurrency}"
    )

    limit = 0 if concurrency is None else concurrency + 2  # 0: no connection limit
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(prompt: list[int] | str) -> RequestRecord:
            payload = build_payload(endpoint, model, prompt, output_len, temperature)
            fallback = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            return await _send_one(session, url, payload, endpoint, headers, fallback)

        async def closed_loop(items: list, c: int, cb: Callable[[RequestRecord], None]) -> list:
            results: list[Optional[RequestRecord]] = [None] * len(items)
            it = iter(range(len(items)))

            async def worker() -> None:
                for i in it:  # shared iterator: each index is taken by one worker
                    rec = await one(items[i])
                    results[i] = rec
                    cb(rec)

            await asyncio.gather(*(worker() for _ in range(min(c, len(items)))))
            return results

        if warm_prompts:
            wp = _Progress(f"{lvl_label} warmup", len(warm_prompts), progress)
            await closed_loop(warm_prompts, concurrency or len(warm_prompts), wp.update)

        prog = _Progress(lvl_label, num_prompts, progress)

        def done_cb(rec: RequestRecord) -> None:
            prog.update(rec)
            if on_record is not None:
                on_record(rec)

        t0 = time.perf_counter()
        if request_rate is None:
            records = await closed_loop(prompts, concurrency, done_cb)
        else:
            arrival_rng = random.Random(seed + 7919)
            sem = asyncio.Semaphore(concurrency) if concurrency else None

            async def limited(prompt: list[int] | str) -> RequestRecord:
                if sem is None:
                    rec = await one(prompt)
                else:
                    async with sem:
                        rec = await one(prompt)
                done_cb(rec)
                return rec

            tasks = []
            for i, prompt in enumerate(prompts):
                if i:
                    await asyncio.sleep(arrival_rng.expovariate(request_rate))
                tasks.append(asyncio.create_task(limited(prompt)))
            records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0

    summary = summarize(records, duration, slo_ttft_ms, slo_tpot_ms, percentiles)
    level = {
        "label": lvl_label,
        "model": model,
        "endpoint": endpoint,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "seed": seed,
        "warmup": warmup,
        "temperature": temperature,
    }
    level.update(summary)
    return level


# --------------------------------------------------------------------------------------
# Output: table, JSON, plot
# --------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def format_table(levels: Sequence[dict]) -> str:
    cols = [
        ("level", lambda l: l["label"]),
        ("ok", lambda l: str(l["completed"])),
        ("fail", lambda l: str(l["failed"])),
        ("req/s", lambda l: _fmt(l["request_throughput"], 2)),
        ("out tok/s", lambda l: _fmt(l["output_throughput"])),
        ("tot tok/s", lambda l: _fmt(l["total_token_throughput"])),
        ("TTFT p50/p99 ms", lambda l: f"{_fmt(l.get('p50_ttft_ms'))}/{_fmt(l.get('p99_ttft_ms'))}"),
        ("TPOT p50/p99 ms", lambda l: f"{_fmt(l.get('p50_tpot_ms'))}/{_fmt(l.get('p99_tpot_ms'))}"),
        ("ITL p50/p99 ms", lambda l: f"{_fmt(l.get('p50_itl_ms'))}/{_fmt(l.get('p99_itl_ms'))}"),
        ("E2E p50/p99 ms", lambda l: f"{_fmt(l.get('p50_e2el_ms'))}/{_fmt(l.get('p99_e2el_ms'))}"),
        ("goodput req/s", lambda l: _fmt(l.get("goodput"), 2)),
    ]
    rows = [[name for name, _ in cols]] + [[fn(l) for _, fn in cols] for l in levels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = []
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def store_results(path: str | os.PathLike, run: dict) -> None:
    """Append ``run`` to ``{"runs": [...]}`` in ``path`` (created, with parents, if absent)."""
    p = Path(path)
    doc: dict = {"runs": []}
    if p.exists() and p.stat().st_size > 0:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
            raise ValueError(f"{p} exists but is not a benchmark results file ({{'runs': [...]}})")
    doc["runs"].append(run)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, p)


def restart_with_memory_env(module: str, argv=None, say=None) -> None:
    """Run this benchmark again (``python -m module`` with the same arguments) with a
    replica's glibc settings (``app.builder.MEMORY_ENV``), unless it has them already:
    glibc reads them when the process starts. Returns only when they are in place; a
    benchmark doing a worker's or a data-plane replica's part then reuses freed read
    buffers as they do instead of faulting in fresh pages."""
    from app.builder import MEMORY_ENV

    if all(os.environ.get(k) == v for k, v in MEMORY_ENV.items()):
        return
    if say is not None:
        say("starting again with a worker's malloc settings (app.builder.MEMORY_ENV)")
    sys.stdout.flush()
    args = sys.argv[1:] if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **MEMORY_ENV})


def _process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's (command line, CPU seconds: user + system) from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        out[int(entry)] = (cmdline or comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_role(pid: int, cmdline: str) -> str:
    """Which part of a data-plane benchmark a process is: ``this process`` (the
    benchmark, doing a worker's part), ``redis``, ``data plane`` (its Serve replicas),
    ``ray`` (raylet, GCS, Serve's controller and proxies, dashboard, agents) or ``other``
    (the rest of the machine)."""
    if pid == os.getpid():
        return "this process"
    if cmdline.startswith("redis-") or "/redis-server" in cmdline.split(" ", 1)[0]:
        return "redis"
    if "ServeReplica:" in cmdline and "DataPlane" in cmdline:
        return "data plane"
    if cmdline.startswith("ray::") or "/ray/" in cmdline or "/ray_" in cmdline or cmdline.startswith(("raylet", "gcs_server")):
        return "ray"
    return "other"


class CpuMeter:
    """CPU seconds every process on this machine spent between :meth:`start` and
    :meth:`stop`, summed by :func:`cpu_role`, plus this process's children that exited
    meanwhile (a ``redis-benchmark`` run: ``child``). On 2 cores shared by the client,
    Redis, the data plane and Ray, throughput is bounded by the CPU each byte costs all
    of them together: :meth:`per_gb` says where it goes. ``role``: another grouping,
    ``role(pid, cmdline)``. Linux only (``/proc``); resolution is the kernel's clock tick
    (10 ms)."""

    def __init__(self, role=cpu_role) -> None:
        self._role = role
        self._before: dict[int, tuple[str, float]] = {}
        self._children = 0.0
        self.seconds: dict[str, float] = {}

    @staticmethod
    def _children_cpu() -> float:
        t = os.times()
        return t.children_user + t.children_system

    def start(self) -> "CpuMeter":
        self._before = _process_cpu()
        self._children = self._children_cpu()
        return self

    def stop(self) -> dict[str, float]:
        after = _process_cpu()
        seconds: dict[str, float] = {}
        for pid, (cmdline, cpu) in after.items():
            used = cpu - self._before.get(pid, (cmdline, 0.0))[1]
            if used > 0:
                role = self._role(pid, cmdline)
                seconds[role] = seconds.get(role, 0.0) + used
        child = self._children_cpu() - self._children
        if child > 0:
            seconds["child"] = child
        self.seconds = seconds
        return seconds

    def per_gb(self, nbytes: int) -> dict[str, float]:
        """CPU seconds per GB moved (``nbytes`` in the measured span), by role, and
        their ``total``."""
        gb = nbytes / 1e9
        out = {role: s / gb for role, s in sorted(self.seconds.items())}
        out["total"] = sum(self.seconds.values()) / gb
        return out


def write_report(path: str | os.PathLike, doc: dict) -> Path:
    """Write one comparison's report as JSON (parents created), replacing the file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2))
    return p


def add_kv_redis_option(parser: argparse.ArgumentParser) -> None:
    """``--kv-redis cache|shared`` of the side-by-side benchmarks that start their own
    Redis: where the KV blocks go (see :func:`start_kv_redis`)."""
    parser.add_argument(
        "--kv-redis",
        choices=["cache", "shared"],
        default="cache",
        help="cache: KV blocks on their own cache redis-server (no persistence, maxmemory, "
        "allkeys-lru), as serve_config.yaml deploys them; shared: on the sessions' AOF server",
    )


def add_write_behind_yield_option(parser: argparse.ArgumentParser) -> None:
    """``--write-behind-yield-ms`` of the benchmarks that deploy a data plane
    (``dataplane.write_behind_yield_ms``; None: the config's)."""
    parser.add_argument(
        "--write-behind-yield-ms", type=int, default=None,
        help="dataplane.write_behind_yield_ms (default: the config's; 0: write behind every "
        "sync_interval_ms even while puts arrive, as before 2026-12-06's seventeenth session)",
    )


def add_ingress_option(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--ingress auto|serve-proxy|haproxy`` of the side-by-side benchmarks that start
    their own Ray: what takes the app's HTTP port, as ``llm-serve run --ingress`` (whose
    default, ``auto``, is HAProxy where it can start, else Serve's proxy)."""
    from app.builder import INGRESS_CHOICES

    parser.add_argument(
        "--ingress", choices=INGRESS_CHOICES, default=default,
        help="what takes the app's HTTP port (as `llm-serve run --ingress`)",
    )


def start_kv_redis(kv_redis: str, stack: contextlib.ExitStack):
    """For ``--kv-redis cache``: a cache redis-server for the KV blocks (``LocalRedis``,
    stopped with ``stack``); None for ``shared`` (blocks on the sessions' server)."""
    from app.local_redis import LocalRedis

    return stack.enter_context(LocalRedis(cache_max_memory="4gb")) if kv_redis == "cache" else None


def plot_levels(path: str | os.PathLike, levels: Sequence[dict], title: str = "") -> bool:
    """Throughput and latency vs. load level as a PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [
        l["request_rate"] if l.get("request_rate") is not None else l["concurrency"]
        for l in levels
    ]
    xlabel = "request rate (req/s)" if levels and levels[0].get("request_rate") else "concurrency"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(xs, [l["output_throughput"] for l in levels], "o-", label="output tok/s")
    axes[0].plot(xs, [l["total_token_throughput"] for l in levels], "s--", label="total tok/s")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    for ax, metric, name in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ys = [l.get(f"{p}_{metric}_ms") for l in levels]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=f"{name} {p}")
        ax.set_ylabel("ms")
        ax.legend()
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def _float_list(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {s!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.benchmark",
        description="Benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput, goodput).",
    )
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", type=_int_list, default=None,
                   help="closed-loop levels, e.g. 1,8,32 (each run in turn; default 1); with "
                   "--request-rate, the largest value caps requests in flight (default: no cap)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default max(8, 4*C); with --request-rate max(8, 4*ceil(rate)))")
    p.add_argument("--request-rate", type=_float_list, default=None,
                   help="Poisson open loop at these rates (req/s, comma list) instead of closed loop")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (words for chat)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos is sent)")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids drawn from [10, vocab) (default 1000)")
    p.add_argument("--tokenizer-dir", default=None, help="read vocab_size from DIR/config.json")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompt seed; level i uses seed+i")
    p.add_argument("--warmup", type=int, default=0, help="unmeasured requests before the first level")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--label", default=None, help="name stored with this run in --out")
    p.add_argument("--out", default=None, help="JSON file; this run is appended to its 'runs'")
    p.add_argument("--plot", default=None, help="PNG of throughput/latency vs. level (needs matplotlib)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request total timeout")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="sent as Authorization: Bearer (default $OPENAI_API_KEY)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


async def _amain(args: argparse.Namespace) -> int:
    if args.vocab_size is not None and args.tokenizer_dir is not None:
        print("error: give --vocab-size or --tokenizer-dir, not both", file=sys.stderr)
        return 2
    try:
        vocab = args.vocab_size or (
            read_vocab_size(args.tokenizer_dir) if args.tokenizer_dir else 1000
        )
    except (OSError, ValueError) as e:
        print(f"error: --tokenizer-dir: {e}", file=sys.stderr)
        return 2
    for name in ("input_len", "output_len", "num_prompts"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if vocab <= MIN_TOKEN_ID:
        print(f"error: vocab size must be > {MIN_TOKEN_ID}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        try:
            model = await fetch_first_model(args.base_url, args.api_key, min(args.timeout_s, 30.0))
        except Exception as e:  # noqa: BLE001
            print(f"error: cannot list models at {args.base_url}: {e}", file=sys.stderr)
            return 2
    if args.request_rate is not None:
        cap = max(args.concurrency) if args.concurrency else None
        plan = [(cap, r) for r in args.request_rate]
    else:
        plan = [(c, None) for c in (args.concurrency or [1])]

    levels = []
    for i, (c, rate) in enumerate(plan):
        if args.num_prompts is not None:
            n = args.num_prompts
        elif rate is not None:
            n = max(8, 4 * math.ceil(rate))
        else:
            n = max(8, 4 * c)
        lvl = await run_level(
            args.base_url, model, c, n,
            endpoint=args.endpoint, input_len=args.input_len, output_len=args.output_len,
            request_rate=rate, seed=args.seed + i, warmup=args.warmup if i == 0 else 0,
            vocab_size=vocab, temperature=args.temperature, timeout_s=args.timeout_s,
            api_key=args.api_key, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            progress=not args.quiet,
        )
        levels.append(lvl)
        if lvl["failed"]:
            print(f"[{lvl['label']}] {lvl['failed']} failed; first errors:", file=sys.stderr)
            for e in lvl["errors"]:
                print(f"  - {e}", file=sys.stderr)

    print(format_table(levels))
    run = {
        "label": args.label,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "base_url": args.base_url,
        "model": model,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "levels": levels,
    }
    if args.out:
        store_results(args.out, run)
        print(f"results appended to {args.out}", file=sys.stderr)
    if args.plot:
        if plot_levels(args.plot, levels, title=args.label or model):
            print(f"plot written to {args.plot}", file=sys.stderr)
        else:
            print("plot skipped: matplotlib is not importable", file=sys.stderr)
    return 0 if all(l["completed"] for l in levels) else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(_amain(args))


if __name__ == "__main__":
    sys.exit(main())
