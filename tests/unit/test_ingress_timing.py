"""The ingress's TTFT and end-to-end latency count from when it took the request: the time
it spends building the prompt (the session's history, the chat template, tokenising) is
the client's wait too, and the log line says how much of it that was (``prompt_ms``)."""

import asyncio
import json
import logging
from types import SimpleNamespace

from app.auth import ApiKeys
from app.config import AppConfig
from app.ingress import Ingress
from app.schemas import ChatCompletionRequest
from app import telemetry
from deployments.compute.engines.protocol import TokenDelta
from tests.fixtures.logs import log_fields, messages_containing, serve_log_captured

PROMPT_DELAY_S = 0.2


class _Recorded:
    def __init__(self):
        self.values = []

    def inc(self, *a, **k):
        pass

    def observe(self, value, *a, **k):
        self.values.append(value)


class _Router:
    max_tenant_places = 512

    def reject_if_full(self, tenant):
        pass

    async def generate(self, request, gate=None, session_lookup=None):
        yield TokenDelta(token_ids=[7], text="a", num_output_tokens=1)
        yield TokenDelta(token_ids=[8], text="b", num_output_tokens=2, finish_reason="length")


class _Request:
    headers = {}

    def __init__(self, stream: bool):
        self._body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}

    async def stream(self):
        yield json.dumps(self._body).encode()


def _ingress() -> Ingress:
    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig(model={"id": "tiny"})
    ing._stopping = set()
    ing._sessions = None
    ing._limiter = None  # no rate limits
    ing._reply_parser = None  # no parsers of the reply
    ing._keys = ApiKeys(env_var=None)  # none: every request is tenant "default"
    ing._router = _Router()
    ing._tracer = telemetry.tracer(__name__)
    ing._tokenizer = [None] * 100  # len(): the vocabulary's size
    ing._max_model_len = 64
    ing._m = SimpleNamespace(
        **{k: _Recorded() for k in ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens", "session_cache")}
    )

    async def slow_prompt(req, request, sessions, early_session=None):
        await asyncio.sleep(PROMPT_DELAY_S)  # a slow session read, a long history to tokenise
        return [1, 2, 3], None, None

    ing._chat_prompt = slow_prompt
    return ing


async def _serve(ing, stream: bool) -> bytes:
    response = await ing._serve("chat", _Request(stream), ChatCompletionRequest)
    assert response.status_code == 200, response.body
    if not stream:
        return response.body
    return b"".join([c async for c in response.body_iterator])


def _request_done(ing, caplog, stream: bool) -> tuple[bytes, dict]:
    with serve_log_captured(caplog, logging.INFO):
        body = asyncio.run(_serve(ing, stream))
    [line] = messages_containing(caplog, "request done")
    return body, log_fields(line)


def test_ttft_counts_the_time_spent_building_the_prompt(caplog):
    ing = _ingress()
    body, fields = _request_done(ing, caplog, stream=True)
    assert b'"content":"b"' in body.replace(b" ", b"") and body.endswith(b"data: [DONE]\n\n")
    # The deltas come at once from the fake router: all of the wait is the prompt's.
    assert len(ing._m.ttft.values) == 1 and ing._m.ttft.values[0] >= PROMPT_DELAY_S
    assert ing._m.e2e.values[0] >= PROMPT_DELAY_S
    assert float(fields["prompt_ms"]) >= 1000 * PROMPT_DELAY_S
    assert float(fields["ttft_ms"]) >= float(fields["prompt_ms"])


def test_a_buffered_request_counts_it_in_its_latency(caplog):
    ing = _ingress()
    body, fields = _request_done(ing, caplog, stream=False)
    assert json.loads(body)["choices"][0]["message"]["content"] == "ab"
    assert ing._m.ttft.values == []  # its client sees no first token before the end
    assert len(ing._m.e2e.values) == 1 and ing._m.e2e.values[0] >= PROMPT_DELAY_S
    assert float(fields["prompt_ms"]) >= 1000 * PROMPT_DELAY_S
    assert float(fields["e2e_ms"]) >= float(fields["prompt_ms"])
