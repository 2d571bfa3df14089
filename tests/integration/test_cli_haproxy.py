"""The README's run command: ``python -m app.cli run`` in a subprocess, on the project's
own ``serve_config.yaml`` (tiny model, torch engine, embedded Redis on free ports), whose
default ingress (``auto``) puts HAProxy on the HTTP port where it can start, as here.

HAProxy is shown to be in the path (its stats page answers, on a port given here); then a
streamed chat, OpenAI errors, a session turn and /ready go through it; Ctrl-C stops every
process. The CLI starts a Ray of its own (its own temp dir), apart from the suite's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fixtures.models import REPO_ROOT, get_model_path
from tests.fixtures.serve_app import free_port, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def cli_haproxy():
    http_port, stats_port, metrics_port = free_port(), free_port(), free_port()
    doc = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    doc["http_options"]["port"] = http_port
    if doc.get("grpc_options"):
        doc["grpc_options"]["port"] = free_port()
    args = doc["applications"][0]["args"]
    args["model"]["path"] = str(get_model_path("tiny"))
    dp = args["dataplane"]
    dp["num_replicas"] = 1
    dp["redis"]["url"] = f"redis://127.0.0.1:{free_port()}/0"
    if dp.get("kv_redis"):
        dp["kv_redis"]["url"] = f"redis://127.0.0.1:{free_port()}/0"
    # Short: a Unix socket path under it must stay within 107 bytes.
    tmp = tempfile.mkdtemp(prefix="clihap", dir="/tmp")
    config = Path(tmp) / "serve_config.yaml"
    config.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_TMPDIR=str(Path(tmp) / "ray"),
        RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port),
        RAY_SERVE_HAPROXY_METRICS_PORT=str(metrics_port),
    )
    log = open(Path(tmp) / "cli.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run", "--config", str(config),
         "--state-dir", str(Path(tmp) / "state"), "--num-cpus", "8", "--ready-timeout-s", "300"],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{http_port}"

    def output() -> str:
        log.flush()
        return (Path(tmp) / "cli.log").read_text()[-3000:]

    try:
        wait_for(lambda: "ready at" in output() or proc.poll() is not None, 360, "the CLI to be ready")
        assert proc.poll() is None, output()
        yield proc, base, stats_port, output
    finally:
        if proc.poll() is None:
            # Ctrl-C first: Ray stops its HAProxy, which a SIGKILL of the CLI's group
            # would leave holding the ports (HAProxy is not in that group).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_cli_serves_through_haproxy_by_default_and_stops_on_ctrl_c(cli_haproxy):
    proc, base, stats_port, output = cli_haproxy
    assert f"ingress: HAProxy (its stats on :{stats_port}" in output()
    with httpx.Client(base_url=base, timeout=120) as c:
        # HAProxy holds the port: its stats page (a port of its own) lists the frontend.
        stats = httpx.get(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=10)
        assert stats.status_code == 200 and "http_frontend" in stats.text, stats.text[:500]

        ready = c.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text

        # A streamed chat: SSE chunks, one finish_reason, then [DONE].
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6, "stream": True, "temperature": 0}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [ch["choices"][0]["finish_reason"] for ch in chunks].count("length") == 1
        streamed = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        plain = c.post("/v1/chat/completions", json={**body, "stream": False})
        assert plain.status_code == 200
        assert plain.json()["choices"][0]["message"]["content"] == streamed  # greedy: same text

        # Errors keep their status and the OpenAI shape through HAProxy.
        bad = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        unknown = c.post("/v1/chat/completions", json={**body, "model": "nope", "stream": False})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        # A session turn is stored.
        sid = c.post("/v1/sessions").json()["id"]
        turn = c.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                      json={**body, "stream": False, "messages": [{"role": "user", "content": "remember"}]})
        assert turn.status_code == 200, turn.text
        session = c.get(f"/v1/sessions/{sid}").json()
        assert session["version"] == 1 and session["messages"][0]["content"] == "remember"

    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=90) == 0, output()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CLI did not stop within 90 s of Ctrl-C:\n{output()}")
    print(f"stopped {time.monotonic() - started:.1f}s after Ctrl-C")
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/ready", timeout=5)
