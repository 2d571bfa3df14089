"""Locust user sending the same traffic as ``python -m loadtests.benchmark``.

Each user is one closed-loop client (no wait between requests): N users = N requests in
flight. A request is a streamed ``/v1/completions`` call with an exact-length prompt of
random token ids, ``max_tokens = --output-len`` and ``ignore_eos: true``.

Reported in Locust's statistics (all in milliseconds):

* ``POST /v1/completions (stream)`` -- end-to-end latency (until ``data: [DONE]``);
  response length = output tokens; failures = HTTP errors, error events, cut streams;
* ``TTFT /v1/completions`` -- time to the first chunk with non-empty text;
* ``TPOT /v1/completions`` -- (E2E - TTFT) / (output tokens - 1), requests with > 1 token.

Run (headless, 8 users)::

    locust -f loadtests/locustfile.py --headless -u 8 -r 8 -t 60s \
        --input-len 128 --output-len 64 --csv loadtests/results/locust

Options (or environment variables): ``--input-len`` (LOCUST_INPUT_LEN, 128),
``--output-len`` (LOCUST_OUTPUT_LEN, 64), ``--model`` (LOCUST_MODEL, default: first id of
GET /v1/models), ``--vocab-size`` (LOCUST_VOCAB_SIZE, 1000), ``--prompt-seed``
(LOCUST_PROMPT_SEED, 0), ``--api-key`` (LOCUST_API_KEY). Default host http://127.0.0.1:8000.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path

from locust import HttpUser, constant, events, task
from locust.exception import StopUser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtests.benchmark import SSEParser, build_payload, make_token_prompt  # noqa: E402

DEFAULT_HOST = "http://127.0.0.1:8000"
_user_ids = itertools.count()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--input-len", type=int, default=128, env_var="LOCUST_INPUT_LEN",
                       help="prompt length in tokens")
    parser.add_argument("--output-len", type=int, default=64, env_var="LOCUST_OUTPUT_LEN",
                       help="max_tokens (ignore_eos is sent)")
    parser.add_argument("--model", default="", env_var="LOCUST_MODEL",
                       help="model id (default: first id of GET /v1/models)")
    parser.add_argument("--vocab-size", type=int, default=1000, env_var="LOCUST_VOCAB_SIZE",
                       help="token ids are drawn from [10, vocab-size)")
    parser.add_argument("--prompt-seed", type=int, default=0, env_var="LOCUST_PROMPT_SEED",
                       help="user i draws prompts from random.Random(seed * 100003 + i)")
    parser.add_argument("--api-key", default="", env_var="LOCUST_API_KEY", is_secret=True,
                       help="sent as Authorization: Bearer")


class CompletionsUser(HttpUser):
    host = DEFAULT_HOST
    wait_time = constant(0)  # closed loop: users = requests in flight
    _model: str | None = None  # shared by all users once resolved

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.input_len = int(getattr(opts, "input_len", 128))
        self.output_len = int(getattr(opts, "output_len", 64))
        self.vocab_size = int(getattr(opts, "vocab_size", 1000))
        seed = int(getattr(opts, "prompt_seed", 0))
        self.rng = random.Random(seed * 100003 + next(_user_ids))
        api_key = getattr(opts, "api_key", "") or ""
        self.headers = {"Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        model = getattr(opts, "model", "") or CompletionsUser._model
        if not model:
            with self.client.get("/v1/models", headers=self.headers, name="/v1/models",
                                 catch_response=True) as resp:
                try:
                    model = resp.json()["data"][0]["id"]
                except Exception as e:  # noqa: BLE001
                    resp.failure(f"cannot read a model id from /v1/models: {e}")
                    raise StopUser()
        CompletionsUser._model = model
        self.model = model

    def _fire(self, kind: str, ms: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=kind, name="/v1/completions", response_time=ms,
            response_length=length, exception=None, context={},
        )

    @task
    def stream_completion(self) -> None:
        prompt = make_token_prompt(self.rng, self.input_len, self.vocab_size)
        payload = build_payload("completions", self.model, prompt, self.output_len, 0.0)
        start = time.perf_counter()
        ttft = None
        chunks = 0
        completion_tokens = None
        done = False
        error = None
        with self.client.post("/v1/completions", json=payload, headers=self.headers,
                              stream=True, catch_response=True,
                              name="/v1/completions (stream)") as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            parser = SSEParser()
            try:
                for raw in resp.iter_content(chunk_size=None):
                    now = time.perf_counter()
                    for data in parser.feed(raw):
                        if data.strip() == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if obj.get("error"):
                            error = f"error event: {obj['error']}"
                            break
                        choices = obj.get("choices") or []
                        if choices and (choices[0] or {}).get("text"):
                            chunks += 1
                            if ttft is None:
                                ttft = now - start
                        usage = obj.get("usage") or {}
                        if usage.get("completion_tokens") is not None:
                            completion_tokens = int(usage["completion_tokens"])
                    if done or error:
                        break
            except Exception as e:  # noqa: BLE001 - transport or JSON error
                error = f"{type(e).__name__}: {e}"
            e2e = time.perf_counter() - start
            resp.request_meta["response_time"] = e2e * 1000.0
            out_tokens = completion_tokens if completion_tokens is not None else chunks
            resp.request_meta["response_length"] = out_tokens
            if error or not done:
                resp.failure(error or "stream ended before data: [DONE]")
                return
            resp.success()
        if ttft is not None:
            self._fire("TTFT", ttft * 1000.0)
            if out_tokens > 1:
                self._fire("TPOT", (e2e - ttft) * 1000.0 / (out_tokens - 1), out_tokens)
