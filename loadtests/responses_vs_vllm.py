"""A multi-turn conversation through OpenAI's Responses API (each turn continues the last
with ``previous_response_id``, streamed): our application with the vLLM engine against
``vllm serve`` with its own stored responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``),
the same engine options, alternated per round on the tiny checkpoint.

    python -m loadtests.responses_vs_vllm [--rounds 3] [--turns 8] [--out FILE.json]

Each turn sends --turn-words words and gets --reply-tokens tokens (``ignore_eos``), so
the context grows by about a turn and a reply each time; --conversations conversations run
one after another per system and round. Reported per turn: TTFT (median over rounds and
conversations) and the prompt tokens the engine found cached
(``usage.input_tokens_details.cached_tokens``), and the ratio vLLM / ours of TTFT over
turns >= 4. Both keep the conversation on the server; they differ in what the next
prompt is made of: ours splices the reply's generated token ids back in (the stored
response keeps them), vLLM's server renders the stored messages' text again and
tokenises it, which need not give the ids the model generated. Our application runs with
its data plane (stored responses need it) and so with vLLM's KV connector; vLLM's own
prefix cache serves both. Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from loadtests.benchmark import write_report
from loadtests.compare_vllm import MODEL_NAME, OurApp, VLLMServer, add_load_options, prepare, vllm_flags
from loadtests.multiturn import WORDS

SYSTEMS = ("ours", "vllm")


def _say(msg: str) -> None:
    print(f"[responses_vs_vllm] {msg}", file=sys.stderr, flush=True)


class OurAppWithStore(OurApp):
    """Our application with its data plane (and so its stored responses) on a local Redis."""

    def __init__(self, model_path: Path, args, port: int, redis_url: str):
        super().__init__(model_path, args, port)
        self.app_args["dataplane"] = {"enabled": True, "num_replicas": 1, "redis": {"url": redis_url}}


def turn(client: httpx.Client, previous: Optional[str], text: str, reply_tokens: int) -> tuple[float, int, str]:
    """TTFT (the first output text delta), cached prompt tokens and the id of one turn."""
    body = {"model": MODEL_NAME, "input": text, "max_output_tokens": reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    start = time.perf_counter()
    ttft, final = None, None
    with client.stream("POST", "/v1/responses", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if ttft is None and event["type"] == "response.output_text.delta":
                ttft = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                final = event
    if ttft is None or final is None or "response" not in final or final["type"] == "response.failed":
        raise RuntimeError(f"the turn ended without text or with an error: {json.dumps(final)[:300]}")
    response = final["response"]
    return ttft, response["usage"]["input_tokens_details"]["cached_tokens"], response["id"]


def conversation(base_url: str, args, seed: int) -> tuple[list[float], list[int]]:
    rng = random.Random(seed)
    ttfts, cached, previous = [], [], None
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for _ in range(args.turns):
            text = " ".join(rng.choice(WORDS) for _ in range(args.turn_words))
            time.sleep(args.think_s)
            ttft, hit, previous = turn(client, previous, text, args.reply_tokens)
            ttfts.append(ttft)
            cached.append(hit)
    return ttfts, cached


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.responses_vs_vllm")
    add_load_options(p)
    p.set_defaults(rounds=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-words", type=int, default=25)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--conversations", type=int, default=2, help="per system and round")
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--out", default="loadtests/results/responses_vs_vllm.json")
    args = p.parse_args(argv)
    model_path = prepare(args)
    base_url = f"http://127.0.0.1:{args.port}"
    ttfts: dict[str, list[list[float]]] = {s: [] for s in SYSTEMS}
    cached: dict[str, list[list[int]]] = {s: [] for s in SYSTEMS}
    from app.local_redis import LocalRedis

    with LocalRedis() as redis, contextlib.ExitStack():
        os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # vLLM's server: keep responses
        servers = {
            "ours": OurAppWithStore(model_path, args, args.port, redis.url),
            "vllm": VLLMServer(vllm_flags(model_path, args), args.port, Path("/tmp/responses_vs_vllm_server.log")),
        }
        for rnd in range(args.rounds):
            order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                server = servers[system]
                _say(f"round {rnd + 1}/{args.rounds}: starting {system}")
                server.start(args.start_timeout_s)
                try:
                    # One unmeasured conversation first (first-use costs of either server).
                    conversation(base_url, argparse.Namespace(**{**vars(args), "turns": 2, "think_s": 0}), 7 + rnd)
                    for c in range(args.conversations):
                        # The same words for both systems in a round: the same prompts.
                        t, h = conversation(base_url, args, 1000 * rnd + c)
                        ttfts[system].append(t)
                        cached[system].append(h)
                        _say(f"  {system} conversation {c + 1}: ttft ms "
                             + " ".join(f"{1000 * x:.0f}" for x in t) + " | cached " + " ".join(map(str, h)))
                finally:
                    server.stop()

    def per_turn(table, scale=1.0):
        return {s: [scale * statistics.median(c[t] for c in table[s]) for t in range(args.turns)] for s in SYSTEMS}

    ttft_ms, hits = per_turn(ttfts, 1000.0), per_turn(cached)
    late = range(3, args.turns)
    ratio = statistics.median(ttft_ms["vllm"][t] / ttft_ms["ours"][t] for t in late) if late else None
    print("turn   ours ms   vllm ms   ours cached   vllm cached   (medians)")
    for t in range(args.turns):
        print(f"{t + 1:>4} {ttft_ms['ours'][t]:>9.1f} {ttft_ms['vllm'][t]:>9.1f} "
              f"{hits['ours'][t]:>13.0f} {hits['vllm'][t]:>13.0f}")
    print(json.dumps({"vllm_over_ours_ttft_turns_ge4": ratio}))
    report = {"args": vars(args), "ttft_ms_by_turn": ttft_ms, "cached_tokens_by_turn": hits,
              "vllm_over_ours_ttft_turns_ge4": ratio, "raw_ttft_s": ttfts, "raw_cached": cached}
    _say(f"stored {write_report(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
