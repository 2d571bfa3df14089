"""Multi-turn chat benchmark: time to first token per turn with KV reuse from host memory
(L2), from Redis (L3) and with reuse off (recompute), side by side in one run.

    python -m loadtests.multiturn [--preset small] [--turns 8] [--rounds 2] [--kv-redis cache|shared] [--out FILE]

Each conversation is a server-side session (X-Session-Id); every turn sends only its new
user message (--turn-words words, about 3 tokens each), the reply is --reply-tokens long, so the
context grows to about turns × (turn + reply) tokens. The defaults (25 words ≈ 85 tokens
with the template, 180-token replies) give a chat's shape, short questions and longer
answers, and ~2.1k tokens by turn 8; ``--turn-words 65 --reply-tokens 32`` is the
question-heavy shape (most of each turn is new prompt, so reuse can save less). Each
deployment first runs six unmeasured two-turn conversations, then one unmeasured
conversation of the measured shape (``--cold``: not that one; see below). Modes, alternated per round so that
drift on a shared machine hits them alike:

* ``l1``: KV reuse on with the worker's own prefix cache (``engine.prefix_cache_bytes``,
  the default): blocks stay in the worker's memory, the data plane behind it;
* ``l2``: KV reuse on, the worker's prefix cache off; blocks stay in the data plane's host
  memory between turns;
* ``l3``: KV reuse on; the data plane's host memory is flushed before every turn, so the
  blocks come back from Redis (the worker reads them itself, ``dataplane.direct_l3_reads``);
* ``l3_dataplane``: as ``l3`` with ``direct_l3_reads`` off: the data plane reads them from
  Redis and hands them over through the object store (its own deployment);
* ``recompute``: KV reuse off (``dataplane.kv_reuse: false``); every turn prefills its
  whole context;
* ``responses``: as ``l1``, but the conversation is a chain of OpenAI Responses
  (``POST /v1/responses`` with ``previous_response_id``) instead of a session;
* ``stateless``: as ``l1``, but with no server-side state at all: every turn sends the
  whole conversation to ``/v1/chat/completions``, the replies as the text the client got
  (what a client of a stateless OpenAI server does). Its prefix is found again only as far
  as the replies' text tokenises back to the ids the model generated.

Each turn's reused prompt tokens (``usage``'s cached tokens) are reported per mode too.

Turn 1 has nothing to reuse in any mode: its TTFT with reuse on versus off is the cost of a
miss (lookup + export).

The ratios (recompute over each reuse mode at turns >= 4: the median of the per-turn
ratios of the per-turn median TTFTs; turn 1's miss cost) come from all rounds together,
and again from each round's conversations alone (``ratios_by_round``, with their min,
median and max in ``ratios_spread``): how far one round's figure strays on a shared
machine, which a single figure does not show.

The full-length warm-up conversation is there because each round deploys fresh worker
processes: their first prompts longer than any before grow malloc's heap, and every new
page faults on first write. Recompute's prefills are the long ones, so without it the
measured recompute turns carried a start-up cost (46k faults over 8 turns on the small
model) that a server in steady state does not pay, and the reuse ratios came out higher. Starts its own Redis and Ray; needs the `redis-server` binary.
``--kv-redis cache`` (the default) keeps the KV blocks on a cache redis-server of their own
(no persistence, maxmemory, allkeys-lru) and sessions on an AOF one, as
``serve_config.yaml`` deploys them; ``shared`` puts both on the AOF server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from loadtests.benchmark import (
    add_ingress_option,
    add_kv_redis_option,
    add_write_behind_yield_option,
    start_kv_redis,
    write_report,
)

WORDS = (
    "river stone light garden window morning silver quiet harbor market letter bridge "
    "forest winter candle meadow thunder pocket lantern orchard valley whisper copper "
    "journey signal anchor feather shadow compass ribbon marble canyon glacier"
).split()


MODES = ("l1", "l2", "l3", "l3_dataplane", "recompute", "responses", "stateless")
WARMUP_CONVERSATIONS = 6  # 2 data-plane replicas: all six on one of them has odds 1/32


def _say(msg: str) -> None:
    print(f"[multiturn] {msg}", file=sys.stderr, flush=True)


def app_args(
    model_path: Path,
    redis_url: str,
    kv_reuse: bool,
    num_threads: int,
    l1: bool = False,
    keep_freed_memory: bool = True,
    kv_redis_url: Optional[str] = None,
    prefault_heap_bytes: Optional[int] = None,
    log_level: str = "INFO",
    with_worker: bool = False,
    direct_l3_reads: bool = True,
    model_impl: str = "auto",
    kv_arena_bytes: Optional[int] = None,
    warmup_prefill_tokens: Optional[int] = None,
    direct_calls: bool = True,
    write_behind_yield_ms: Optional[int] = None,
) -> dict:
    engine = {"name": "torch", "num_threads": num_threads, "max_num_seqs": 8, "model_impl": model_impl}
    if kv_arena_bytes is not None:
        engine["kv_arena_bytes"] = kv_arena_bytes
    if warmup_prefill_tokens is not None:
        engine["warmup_prefill_tokens"] = warmup_prefill_tokens
    if not l1:
        engine["prefix_cache_bytes"] = 0
    return {
        "model": {"id": "bench", "path": str(model_path)},
        "engine": engine,
        "compute": {"num_replicas": 1, "num_cpus": 1},
        "router": {"max_batch_size": 1},
        "ingress": {"with_worker": with_worker},
        "limits": {"default_max_tokens": 64},
        "dataplane": {
            "enabled": True,
            "kv_reuse": kv_reuse,
            "num_replicas": 2,
            "direct_l3_reads": direct_l3_reads,
            "direct_calls": direct_calls,
            **({} if write_behind_yield_ms is None else {"write_behind_yield_ms": write_behind_yield_ms}),
            "redis": {"url": redis_url},
            **({"kv_redis": {"url": kv_redis_url}} if kv_redis_url else {}),
        },
        "serve_runtime": {"keep_freed_memory": keep_freed_memory}
        | ({} if prefault_heap_bytes is None else {"prefault_heap_bytes": prefault_heap_bytes}),
        "telemetry": {"log_level": log_level},
    }


def wait_ready(base_url: str, timeout_s: float = 600) -> None:
    from app.cli import wait_ready as poll_ready

    if not poll_ready(base_url, timeout_s):
        raise TimeoutError(f"{base_url} not ready after {timeout_s}s")


def flush_l2(app_name: str) -> None:
    """Drop every data-plane replica's host-memory tier (dirty blocks go to Redis first)."""
    from ray import serve

    handle = serve.get_deployment_handle("DataPlane", app_name=app_name)
    # Keys spread over the hash ring: enough distinct ones reach every replica.
    for i in range(32):
        handle.flush_l2.remote(shard_key=f"flush-{i}").result(timeout_s=60)


def _stream(client: httpx.Client, path: str, body: dict, headers: dict, first: str) -> tuple[float, list[dict]]:
    """TTFT (the first data line holding ``first``) and every JSON data line of a stream."""
    start = time.perf_counter()
    ttft, payloads = None, []
    with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None and first in line:
                ttft = time.perf_counter() - start
            payloads.append(json.loads(line[len("data: "):]))
    if ttft is None:
        raise RuntimeError("no content in the stream")
    return ttft, payloads


def _chat_body(messages: list[dict], reply_tokens: int) -> dict:
    return {
        "model": "bench",
        "messages": messages,
        "max_tokens": reply_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chat_turn(client: httpx.Client, messages: list[dict], reply_tokens: int, headers: dict) -> tuple[float, int, str]:
    """TTFT, reused prompt tokens and the reply's text of one streamed chat turn."""
    ttft, payloads = _stream(client, "/v1/chat/completions", _chat_body(messages, reply_tokens), headers,
                             '"content":"')
    text = "".join((p["choices"][0]["delta"].get("content") or "") for p in payloads if p.get("choices"))
    usage = next(p["usage"] for p in payloads if p.get("usage"))
    return ttft, usage["prompt_tokens_details"]["cached_tokens"], text


def ttft_of_turn(client: httpx.Client, sid: str, text: str, reply_tokens: int) -> tuple[float, int]:
    ttft, cached, _ = _chat_turn(client, [{"role": "user", "content": text}], reply_tokens, {"X-Session-Id": sid})
    return ttft, cached


def response_turn(client: httpx.Client, previous: Optional[str], text: str, reply_tokens: int) -> tuple[float, int, str]:
    """TTFT, reused prompt tokens and the id of one streamed Responses turn."""
    body = {"model": "bench", "input": text, "max_output_tokens": reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    ttft, events = _stream(client, "/v1/responses", body, {}, '"type":"response.output_text.delta"')
    final = events[-1]
    if final["type"] not in ("response.completed", "response.incomplete"):
        raise RuntimeError(f"the response ended with {final['type']}: {json.dumps(final)[:300]}")
    return ttft, final["response"]["usage"]["input_tokens_details"]["cached_tokens"], final["response"]["id"]


def worker_kv_stats(app_name: str, with_worker: bool = False) -> dict:
    from ray import serve

    handle = serve.get_deployment_handle("Server" if with_worker else "ComputeWorker", app_name=app_name)
    return handle.kv_stats.remote().result(timeout_s=60)


def conversation(base_url: str, mode: str, args, seed: int, app_name: str) -> tuple[list[float], list[int]]:
    """TTFT (s) and reused prompt tokens of each turn of one conversation."""
    rng = random.Random(seed)
    ttfts, cached = [], []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        sid = client.post("/v1/sessions").json()["id"] if mode not in ("responses", "stateless") else None
        previous, messages = None, []
        for t in range(args.turns):
            text = " ".join(rng.choice(WORDS) for _ in range(args.turn_words))
            # A person reads and types between turns; the previous turn's KV blocks are
            # written behind in that time (a turn fired at once may find them unsaved).
            time.sleep(args.think_s)
            if mode in ("l3", "l3_dataplane"):
                flush_l2(app_name)
            if mode == "responses":
                ttft, hit, previous = response_turn(client, previous, text, args.reply_tokens)
            elif mode == "stateless":
                messages.append({"role": "user", "content": text})
                ttft, hit, reply = _chat_turn(client, messages, args.reply_tokens, {})
                messages.append({"role": "assistant", "content": reply})
            else:
                ttft, hit = ttft_of_turn(client, sid, text, args.reply_tokens)
            ttfts.append(ttft)
            cached.append(hit)
            _say(f"  {mode} turn {t + 1}: ttft {1000 * ttft:.0f} ms, {hit} prompt tokens reused")
        if sid is not None:
            client.delete(f"/v1/sessions/{sid}")
    return ttfts, cached


def turn_ratios(table: dict[str, list[float]]) -> dict[str, float]:
    """The report's ratios from per-turn TTFTs (``table[mode][turn]``): recompute over
    each reuse mode at turns >= 4 (the median of the per-turn ratios), turn 1 of L2 over
    recompute's (what a miss costs), and the stateless / Responses comparisons."""
    turns = min((len(v) for v in table.values()), default=0)
    late = range(3, turns)  # turns >= 4
    ratios: dict[str, float] = {}
    if "recompute" in table and late:
        for mode in ("l1", "l2", "l3", "l3_dataplane"):
            if mode in table:
                ratios[f"recompute_over_{mode}_turns_ge4"] = statistics.median(
                    table["recompute"][t] / table[mode][t] for t in late
                )
    if "recompute" in table and "l2" in table and turns:
        ratios["miss_cost_turn1_l2_over_recompute"] = table["l2"][0] / table["recompute"][0]
    for slow, fast in (("stateless", "responses"), ("stateless", "l1"), ("responses", "l1")):
        if slow in table and fast in table and late:
            ratios[f"{slow}_over_{fast}_turns_ge4"] = statistics.median(table[slow][t] / table[fast][t] for t in late)
    return ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.multiturn")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--model-dir", default=None)
    p.add_argument("--turns", type=int, default=8)
    # A chat's shape: short questions, longer answers (ShareGPT-like: user turns of tens of
    # tokens, replies of a few hundred); 8 turns reach ~2k tokens of context.
    p.add_argument("--turn-words", type=int, default=25, help="words per user turn (~3 tokens each)")
    p.add_argument("--reply-tokens", type=int, default=180)
    p.add_argument("--think-s", type=float, default=1.5, help="pause between turns")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--modes", default="l1,l2,l3,recompute", help="comma-separated subset of " + ",".join(MODES))
    p.add_argument(
        "--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
        help="run the replicas without serve_runtime.keep_freed_memory (to measure what it saves)",
    )
    p.add_argument(
        "--prefault-heap-bytes", type=int, default=None,
        help="serve_runtime.prefault_heap_bytes of the torch worker (default: the config's; 0 turns it off)",
    )
    p.add_argument(
        "--log-level", default="INFO",
        help="the replicas' log level; DEBUG logs each prefix fetch's lookup, load and decode "
        "times in the worker's replica log (/tmp/ray/session_latest/logs/serve/)",
    )
    add_kv_redis_option(p)
    add_ingress_option(p)
    p.add_argument(
        "--with-worker", action="store_true",
        help="ingress.with_worker: the ingress and its worker in one process (app/server.py)",
    )
    p.add_argument(
        "--model-impl", default="auto", choices=["auto", "native", "transformers"],
        help="engine.model_impl of the torch worker (the engine's own Llama or transformers')",
    )
    p.add_argument(
        "--kv-arena-bytes", type=int, default=None,
        help="engine.kv_arena_bytes of the torch worker (default: the config's; 0 turns the KV arena off)",
    )
    p.add_argument(
        "--warmup-prefill-tokens", type=int, default=None,
        help="engine.warmup_prefill_tokens of the torch worker (default: the config's; 0: no long warm-up prefill)",
    )
    p.add_argument(
        "--cold", action="store_true",
        help="no unmeasured full-length conversation before the measured ones (each mode's first long "
        "prompts then grow a fresh worker's memory while measured)",
    )
    p.add_argument(
        "--no-direct-calls", dest="direct_calls", action="store_false",
        help="dataplane.direct_calls off: the workers' KV calls go through the Serve handle (before 2026-12-06)",
    )
    add_write_behind_yield_option(p)
    p.add_argument("--out", default="loadtests/results/multiturn.json")
    args = p.parse_args(argv)
    wanted = set(args.modes.split(","))
    if not wanted <= set(MODES):
        p.error(f"--modes: unknown {sorted(wanted - set(MODES))}")

    import ray
    from ray import serve

    from app.builder import build_app
    from app.local_redis import LocalRedis
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(args.model_dir or f"models/{args.preset}"), args.preset)
    base_url = f"http://127.0.0.1:{args.port}"
    runs: dict[str, list[list[float]]] = {m: [] for m in MODES}
    reused: dict[str, list[list[int]]] = {m: [] for m in MODES}
    kv: dict[str, list[dict]] = {mode: [] for mode in runs}
    with LocalRedis() as redis, contextlib.ExitStack() as stack:
        kv_server = start_kv_redis(args.kv_redis, stack)
        kv_redis_url = kv_server.url if kv_server is not None else None
        from app.builder import use_serve_process_env

        args.ingress = use_serve_process_env(args.ingress)  # as app.cli does ("auto" resolved)
        print(f"[multiturn] ingress: {args.ingress}", file=sys.stderr, flush=True)
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        for rnd in range(args.rounds):
            for kv_reuse, l1, direct, all_modes in (
                (True, True, True, ("l1", "responses", "stateless")),
                (True, False, True, ("l2", "l3")),
                (True, False, False, ("l3_dataplane",)),
                (False, False, True, ("recompute",)),
            ):
                modes = [m for m in all_modes if m in wanted]
                if not modes:
                    continue
                _say(f"round {rnd + 1}/{args.rounds}: deploying with kv_reuse={kv_reuse} l1={l1} direct_l3_reads={direct}")
                serve.start(http_options={"host": "127.0.0.1", "port": args.port})
                serve.run(
                    build_app(app_args(
                        model_path, redis.url, kv_reuse, args.num_threads, l1, args.keep_freed_memory, kv_redis_url,
                        args.prefault_heap_bytes, args.log_level, args.with_worker, direct, args.model_impl,
                        kv_arena_bytes=args.kv_arena_bytes, warmup_prefill_tokens=args.warmup_prefill_tokens,
                        direct_calls=args.direct_calls, write_behind_yield_ms=args.write_behind_yield_ms,
                    )),
                    name="bench",
                    route_prefix="/",
                    blocking=False,
                )
                wait_ready(base_url)
                # Unmeasured short conversations first, so turn 1 of the first measured
                # mode does not carry the deployment's first-use costs (connections, lazy
                # imports) that recompute's turn 1 would not: turn 1 is the miss-cost figure.
                # Several, because each conversation's blocks and session live on one
                # data-plane replica (by hash) and a replica's first call pays for opening
                # its connections: one warm-up could leave a replica cold.
                warm = argparse.Namespace(**{**vars(args), "turns": 2, "think_s": 0, "reply_tokens": 16})
                for w in range(WARMUP_CONVERSATIONS):
                    conversation(base_url, "warmup", warm, 7 + 100 * rnd + w, "bench")
                if not args.cold:
                    # Then one unmeasured conversation of the measured shape: a fresh
                    # worker's first prompts longer than any before grow its heap, and
                    # each new page faults (46k faults over recompute's 8 turns on the
                    # small model, 3-140 µs each on the VMs here), which a server that
                    # has run a while has paid long ago. Measuring it would charge
                    # recompute (whose prefills are long) a start-up cost that reuse
                    # (short suffixes) does not pay. ``--cold`` leaves it out.
                    full = argparse.Namespace(**{**vars(args), "think_s": 0})
                    conversation(base_url, "warmup-full", full, 9 + 100 * rnd, "bench")
                for mode in modes:
                    # Distinct text per mode and round: one mode must not hit another's blocks.
                    seed = 1000 * rnd + 100 * list(runs).index(mode) + len(runs[mode])
                    before = worker_kv_stats("bench", args.with_worker)
                    ttfts, hits = conversation(base_url, mode, args, seed, "bench")
                    runs[mode].append(ttfts)
                    reused[mode].append(hits)
                    after = worker_kv_stats("bench", args.with_worker)
                    kv[mode].append({k: after[k] - before[k] for k in after if isinstance(after[k], int)})
                    _say(f"  {mode} KV counters: {kv[mode][-1]}")
                serve.shutdown()
        ray.shutdown()

    def per_turn(mode: str) -> list[float]:
        return [1000 * statistics.median(c[t] for c in runs[mode]) for t in range(args.turns)]

    table = {mode: per_turn(mode) for mode in runs if runs[mode]}
    ratios = turn_ratios(table)
    # The same ratios from each round's conversations alone: how far one round's figure
    # strays (each mode has one conversation a round).
    by_round = [
        turn_ratios({m: [1000 * s for s in runs[m][r]] for m in table}) for r in range(args.rounds)
    ]
    spread = {
        k: {"min": min(v), "median": statistics.median(v), "max": max(v)}
        for k in ratios
        if len(v := [r[k] for r in by_round if k in r]) > 1
    }
    print("turn  " + "".join(f"{m:>12}" for m in table) + "   (median TTFT, ms)")
    for t in range(args.turns):
        print(f"{t + 1:>4}  " + "".join(f"{table[m][t]:>12.1f}" for m in table))
    print(json.dumps(ratios, indent=2))
    if spread:
        print("per round: " + json.dumps({k: [round(r[k], 2) for r in by_round if k in r] for k in spread}))
    hits = {m: [statistics.median(c[t] for c in reused[m]) for t in range(args.turns)] for m in table}
    print("turn  " + "".join(f"{m:>12}" for m in table) + "   (median reused prompt tokens)")
    for t in range(args.turns):
        print(f"{t + 1:>4}  " + "".join(f"{hits[m][t]:>12.0f}" for m in table))
    print(json.dumps({"kv_counters_per_conversation": kv}, indent=2))
    report = {"args": vars(args), "ttft_ms_by_turn": table, "ratios": ratios, "ratios_by_round": by_round,
              "ratios_spread": spread, "kv_counters": kv, "raw_s": runs, "reused_prompt_tokens_by_turn": hits}
    _say(f"stored {write_report(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
