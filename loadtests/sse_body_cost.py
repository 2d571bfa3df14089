"""Per-chunk CPU cost of the ingress's chat SSE body alone (no Ray, no socket): 2000
deltas through ``Ingress._stream_body`` from a stand-in stream, best of 5, in µs per
chunk, for the checkout at TREE. Compare two checkouts alternately:

    git worktree add /tmp/old-tree <commit>
    for i in 1 2 3 4 5; do python loadtests/sse_body_cost.py /tmp/old-tree; python loadtests/sse_body_cost.py .; done
"""
import asyncio
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, sys.argv[1])  # noqa: E402 - the checkout to measure
from app.config import AppConfig
from app.ingress import Ingress, _Call
from app.schemas import ChatCompletionRequest
from deployments.compute.engines.protocol import TokenDelta

class _No:
    def inc(self, *a, **k): pass
    observe = inc

class S:
    def __init__(self, items): self.items = items; self.i = 0
    def __aiter__(self): return self
    async def __anext__(self):
        if self.i >= len(self.items): raise StopAsyncIteration
        self.i += 1; return self.items[self.i - 1]
    def cancel(self): pass

ing = Ingress.__new__(Ingress)
ing._config = AppConfig(); ing._stopping = set(); ing._reply_parser = None
ing._m = SimpleNamespace(**{k: _No() for k in ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens", "cached_tokens", "reply_parses")})
ing._record = lambda calls, status: None
req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
N = 2000
async def one():
    deltas = [TokenDelta("ab", [1], None, 3, i + 1) for i in range(N - 1)] + [TokenDelta("c", [2], "stop", 3, N)]
    call = _Call("chat", "r", 3); call.on_delta(deltas[0])
    t = time.perf_counter()
    n = 0
    async for _ in ing._stream_body(req, [call], [deltas[0]], [S(deltas[1:])]):
        n += 1
    return (time.perf_counter() - t) / n * 1e6
best = min(asyncio.run(one()) for _ in range(5))
print(f"{best:.2f}")
