"""``telemetry.keep_log_handlers``: a replica's log file survives a library's logging setup.

Serve writes a replica's log file through a buffering handler (``MemoryHandler``) on the
``ray.serve`` logger. ``logging.config.dictConfig``, which vLLM runs when it builds its
engine, closes every handler of the process, and the buffering handler then drops its
target: the vLLM worker's replica log stopped after its first line. Each case runs in a
subprocess of its own, since dictConfig would close this process's handlers too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.serve_app import vllm_importable

SCRIPT = textwrap.dedent(
    """
    import contextlib, logging, logging.config, logging.handlers, sys
    from app.telemetry import keep_log_handlers

    path, keep, setup = sys.argv[1], sys.argv[2] == "keep", sys.argv[3]
    target = logging.handlers.RotatingFileHandler(path)
    buffered = logging.handlers.MemoryHandler(1, flushLevel=logging.ERROR, target=target)
    serve = logging.getLogger("ray.serve")
    serve.addHandler(buffered)
    serve.setLevel(logging.INFO)
    serve.propagate = False
    serve.info("before")
    with keep_log_handlers() if keep else contextlib.nullcontext():
        if setup == "vllm":
            from vllm.config.logging import LoggingConfig
            from vllm.logger import configure_logging

            configure_logging(LoggingConfig())
        else:  # the shape of vLLM's own config
            logging.config.dictConfig({
                "version": 1,
                "disable_existing_loggers": False,
                "handlers": {"vllm": {"class": "logging.StreamHandler"}},
                "loggers": {"vllm": {"handlers": ["vllm"], "propagate": False}},
            })
    serve.info("after")
    serve.warning("later")
    buffered.flush()
    """
)


def _logged(tmp_path, keep: bool, setup: str) -> list[str]:
    path = tmp_path / f"replica-{keep}-{setup}.log"
    subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), "keep" if keep else "plain", setup],
        check=True, timeout=300,
    )
    return path.read_text().split()


def test_dict_config_closes_the_replica_log_and_keep_log_handlers_undoes_it(tmp_path):
    assert _logged(tmp_path, keep=False, setup="dictconfig") == ["before"]  # the bug
    assert _logged(tmp_path, keep=True, setup="dictconfig") == ["before", "after", "later"]


@pytest.mark.skipif(not vllm_importable(), reason="vLLM is not installed here")
def test_vllms_logging_setup_keeps_the_replica_log(tmp_path):
    assert _logged(tmp_path, keep=False, setup="vllm") == ["before"]
    assert _logged(tmp_path, keep=True, setup="vllm") == ["before", "after", "later"]
