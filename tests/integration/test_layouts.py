"""The two layouts, with each engine: ``ingress.with_worker`` (the Ingress and its
ComputeWorker in one replica, the "Server" deployment, app/server.py) and the Ingress and
ComputeWorker apart. The shared application runs each engine's default (apart for torch;
in one replica for vLLM with one worker replica); this module deploys the other layout
next to it. The other answers the same requests with the same greedy tokens, streams,
keeps a session's turns, and answers bad input with the same errors."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.serve_app import app_args, deployed_app, openai_client, worker_handle

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox"

SERVER_DEPLOYMENTS = {"Server", "DataPlane"}
APART_DEPLOYMENTS = {"Ingress", "ComputeWorker", "DataPlane"}


@pytest.fixture(scope="module")
def other_layout_app(served_app, redis_server, http_port):
    """The layout the shared app does not run, for its engine: (app name, base URL, with_worker)."""
    with_worker = served_app.engine != "vllm"
    args = app_args(
        served_app.model_path,
        redis_server.url,
        engine=served_app.config_args["engine"],
        ingress={"with_worker": with_worker},
    )
    name = f"{'with' if with_worker else 'without'}-worker-{served_app.engine}"
    with deployed_app(args, name, f"/{name}", http_port, timeout_s=300) as base_url:
        yield name, base_url, with_worker


def test_each_engines_default_layout_and_the_other(other_layout_app, served_app):
    from ray import serve

    name, _, with_worker = other_layout_app
    apps = serve.status().applications
    default = set(apps["llm"].deployments)
    other = set(apps[name].deployments)
    # vLLM with one worker replica runs in one process by default; torch apart.
    assert default == (SERVER_DEPLOYMENTS if served_app.engine == "vllm" else APART_DEPLOYMENTS), default
    assert other == (SERVER_DEPLOYMENTS if with_worker else APART_DEPLOYMENTS), other
    # What tools read of a worker, from the Server's own.
    server = serve.get_deployment_handle("Server", app_name=name if with_worker else "llm")
    assert server.stats.remote().result(timeout_s=60).num_running == 0
    assert isinstance(server.kv_stats.remote().result(timeout_s=60), dict)


def test_greedy_output_equals_the_default_layouts(other_layout_app, served_app):
    _, base_url, _ = other_layout_app
    kwargs = dict(model=served_app.model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    default = served_app.client().completions.create(**kwargs)
    other = openai_client(base_url).completions.create(**kwargs)
    assert other.choices[0].text == default.choices[0].text
    assert other.usage.completion_tokens == default.usage.completion_tokens == 12
    assert other.usage.prompt_tokens == default.usage.prompt_tokens


def test_a_stream_has_its_deltas_finish_and_usage(other_layout_app, served_app):
    _, base_url, _ = other_layout_app
    stream = openai_client(base_url).chat.completions.create(
        model=served_app.model_id,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_a_session_keeps_its_turns(other_layout_app, served_app):
    name, base_url, _ = other_layout_app
    worker = worker_handle(name)
    before = worker.kv_stats.remote().result(timeout_s=60)
    sid = httpx.post(base_url + "/v1/sessions", timeout=30).json()["id"]
    client = openai_client(base_url)
    questions = ("Hello there", "And then? " * 8)  # a prompt of whole KV blocks by the second turn
    for question in questions:
        reply = client.chat.completions.create(
            model=served_app.model_id,
            messages=[{"role": "user", "content": question}],
            max_tokens=6,
            temperature=0,
            extra_headers={"X-Session-Id": sid},
        )
        assert reply.choices[0].message.content
    record = httpx.get(f"{base_url}/v1/sessions/{sid}", timeout=30).json()
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    if served_app.engine == "torch":
        # The second turn's prefix lookup, started by the router as the request arrived,
        # reached this layout's engine (a reference, awaited instead of a call of its own).
        after = worker.kv_stats.remote().result(timeout_s=60)
        assert after["early_lookups_used"] > before["early_lookups_used"], (before, after)
        assert after["early_lookups_failed"] == before["early_lookups_failed"], (before, after)
    assert [m["content"] for m in record["messages"][::2]] == list(questions)
    if served_app.engine == "torch":
        # A delete reaches this layout's L1 too: the data plane's broadcast goes to the
        # deployment that runs the engine here ("Server" in one process, else "ComputeWorker").
        dropped = worker.kv_stats.remote().result(timeout_s=60)["l1_dropped_blocks"]
        assert httpx.delete(f"{base_url}/v1/sessions/{sid}", timeout=30).status_code == 200
        assert worker.kv_stats.remote().result(timeout_s=60)["l1_dropped_blocks"] > dropped


def test_bad_input_gets_the_same_errors(other_layout_app, served_app):
    _, base_url, _ = other_layout_app
    r = httpx.post(base_url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base_url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(
        base_url + "/v1/completions",
        json={"model": served_app.model_id, "prompt": "x", "max_tokens": 10**6},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(base_url + "/ready", timeout=30).json()["status"] == "ready"
