"""What running on Ray costs plain vLLM on this machine: the same ``vllm serve`` and load as
``compare_vllm``, alone and next to an idle Ray cluster with Serve (its controller, HTTP
proxy, HAProxy ingress and one trivial deployment, as ``llm-serve run --ingress haproxy``
starts them, without our app), alternated in each round.

    python -m loadtests.ray_background [--rounds 2] [--concurrency 1,8,32] [--out FILE.json]

Neither variant runs any of our code in the request path: whatever separates them is the
CPU Ray's own processes take from vLLM's on the same cores. ``compare_vllm`` measures our
app, which pays that on top of its own work; this is the floor under its ratio. Printed and
stored: the table of levels, the ratios (beside Ray / alone) of output tokens/s and TTFT
p50 per concurrency, and the CPU per 1000 output tokens by process role. Loopback only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from loadtests import compare_vllm as cv
from loadtests.benchmark import format_table, write_report

RAY_PORT = 8125  # the idle Serve app's HTTP port (the bench port is vLLM's)


def _say(msg: str) -> None:
    print(f"[ray_background] {msg}", file=sys.stderr, flush=True)


class _Idle:
    """The trivial deployment Serve runs (what makes it start its controller, proxy and
    HAProxy)."""

    def __call__(self, request) -> str:
        return "ok"


class VLLMBesideRay:
    """An idle Ray + Serve (HAProxy ingress, one trivial replica) started first, then the
    same vLLM server; ``stop`` stops both."""

    def __init__(self, vllm_server: cv.VLLMServer):
        self.vllm = vllm_server
        self.ray_up = False

    def start(self, timeout_s: float) -> float:
        import ray
        from ray import serve

        from app.builder import use_serve_process_env

        started = time.monotonic()
        use_serve_process_env("haproxy")  # as `llm-serve run --ingress haproxy`
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        self.ray_up = True
        serve.start(http_options={"host": "127.0.0.1", "port": RAY_PORT})
        serve.run(serve.deployment(_Idle).bind(), name="idle", route_prefix="/", blocking=False)
        cv.wait_http(f"http://127.0.0.1:{RAY_PORT}/", timeout_s)
        self.vllm.start(timeout_s)
        return time.monotonic() - started

    def stop(self) -> None:
        self.vllm.stop()
        if self.ray_up:
            import ray
            from ray import serve

            self.ray_up = False
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.ray_background")
    cv.add_load_options(p)
    p.add_argument("--out", default="loadtests/results/ray_background.json")
    args = p.parse_args(argv)
    model_path = cv.prepare(args)
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.gettempdir()) / f"ray_background_vllm_{os.getpid()}.log"
    flags = cv.vllm_flags(model_path, args)
    alone = cv.VLLMServer(flags, args.port, log_path)
    beside = VLLMBesideRay(cv.VLLMServer(flags, args.port, log_path))
    _say(f"vllm flags: {' '.join(flags)} (server log: {log_path})")

    try:
        levels, _ = cv.alternate([("beside_ray", beside), ("alone", alone)], base_url, args, _say)
    except KeyboardInterrupt:
        _say("interrupted: everything stopped")
        return 130

    ratios = cv.ratios(levels, args.concurrency, a="beside_ray", b="alone")
    print(format_table(levels))
    cv.print_ratios(ratios, args.concurrency, "beside_ray", "alone")
    cv.print_cpu_by_role(levels)
    _say(f"stored {write_report(args.out, {'args': vars(args), 'levels': levels, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
