"""What vLLM's parsers of a reply (app/reply_parser.py: ``model.tool_call_parser`` under
tool_choice "auto", ``model.reasoning_parser``) add to the ingress per streamed token: the
SSE body of one chat choice (``Ingress._stream_body``, the code a request runs) over the
same engine deltas, with the parsers reading them and without (plain chat), alternated,
in this process. Replies of the tiny model's tokenizer, one token per delta: plain text
(no call) read by the pythonic and hermes tool parsers and by the qwen3 reasoning parser,
and a call of ``--call-words`` words of arguments in each tool parser's format (vLLM's
pythonic parser parses the whole text again at each delta, so its cost per token grows
with the call's length). Also what each request pays before its first token: reading
its parameters into vLLM's request form and building its parser (``for_request`` and
the first ``stream()``), in ms.

    python -m loadtests.reply_parse_cost [--rounds 5] [--tokens 256] [--call-words 16]

Prints µs per token for each variant per round, and the median ratio auto / plain.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from types import SimpleNamespace

from app.config import AppConfig
from app.ingress import Ingress, _Call
from app.schemas import ChatCompletionRequest
from app.telemetry import Every
from app.reply_parser import ReplyParser
from deployments.compute.engines.protocol import TokenDelta

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class _NoMetric:
    def inc(self, *a, **k):
        pass

    observe = inc


class _Stream:
    def __init__(self, items):
        self._it = iter(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        pass


def _ingress(parser) -> Ingress:
    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig()
    ing._stopping = set()
    names = ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens", "reply_parses")
    ing._m = SimpleNamespace(**{k: _NoMetric() for k in names})
    ing._reply_parser = parser
    ing._parse_log = Every(60.0)
    ing._sessions = None
    return ing


def _deltas(tokenizer, text: str, n: int) -> list[TokenDelta]:
    ids = (tokenizer.encode(text, add_special_tokens=False) * n)[:n]
    return [TokenDelta(tokenizer.decode([i]), [i], "stop" if k == n - 1 else None, 5, k + 1) for k, i in enumerate(ids)]


async def _body_seconds(ing, parser, deltas) -> float:
    req = ChatCompletionRequest.model_validate({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stream": True,
        **({"tools": TOOLS} if parser and parser.tool_parser else {})})
    if parser:
        req.reply_parsing = parser.for_request(req)
        req.reply_parsing.prompt_ids = [1, 2, 3]
    call = _Call("chat", "r", 5)
    call.on_delta(deltas[0])
    started = time.perf_counter()
    async for _ in ing._stream_body(req, [call], [deltas[0]], [_Stream(deltas[1:])]):
        pass
    return time.perf_counter() - started


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--call-words", type=int, default=16)
    ap.add_argument("--model", default="models/tiny")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no "request done" line per reply
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    hermes_tok = AutoTokenizer.from_pretrained(args.model)
    hermes_tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    pythonic, hermes = ReplyParser(tok, tool_parser="pythonic"), ReplyParser(hermes_tok, tool_parser="hermes")
    qwen3 = ReplyParser(tok, reasoning_parser="qwen3")
    text = _deltas(tok, "The weather in Paris is mild today, with a light breeze from the west. ", args.tokens)
    words = " ".join(["Paris"] * args.call_words)
    calls = {
        "pythonic": f'[get_weather(city="{words}")]',
        "hermes": f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{words}"}}}}</tool_call>',
    }
    pyc, hc = (_deltas(t, calls[k], len(t.encode(calls[k], add_special_tokens=False)))
               for t, k in ((tok, "pythonic"), (hermes_tok, "hermes")))
    variants = {
        "plain text": (None, text),
        "pythonic, text": (pythonic, text),
        "hermes, text": (hermes, text),
        "qwen3 reasoning, text": (qwen3, text),
        "plain, pythonic call's text": (None, pyc),
        "pythonic, a call": (pythonic, pyc),
        "plain, hermes call's text": (None, hc),
        "hermes, a call": (hermes, hc),
    }
    print(f"calls of {len(pyc)} (pythonic) and {len(hc)} (hermes) tokens", flush=True)
    per_token: dict[str, list[float]] = {k: [] for k in variants}
    print(f"{args.tokens}-token text replies, one token a delta; µs per token", flush=True)
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            parser, deltas = variants[name]
            seconds = asyncio.run(_body_seconds(_ingress(parser), parser, deltas))
            per_token[name].append(1e6 * seconds / len(deltas))
        print(f"round {r + 1}: " + ", ".join(f"{k} {per_token[k][-1]:.1f}" for k in variants), flush=True)
    med = {k: statistics.median(v) for k, v in per_token.items()}
    ratio = {k: med[k] / med[p] for k, p in (("pythonic, text", "plain text"), ("hermes, text", "plain text"),
                                              ("qwen3 reasoning, text", "plain text"),
                                              ("pythonic, a call", "plain, pythonic call's text"),
                                              ("hermes, a call", "plain, hermes call's text"))}
    print("median µs/token: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print("auto / plain (median µs per token): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    setup = {}
    for name, parser in (("pythonic", pythonic), ("hermes", hermes), ("qwen3", qwen3)):
        req = ChatCompletionRequest.model_validate({
            "model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
            **({"tools": TOOLS} if parser.tool_parser else {})})
        for _ in range(50):
            parser.for_request(req).stream()
        started, n = time.perf_counter(), 500
        for _ in range(n):
            parser.for_request(req).stream()
        setup[name] = 1000 * (time.perf_counter() - started) / n
    print("per request (for_request + its parser), ms: " + ", ".join(f"{k} {v:.3f}" for k, v in setup.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
