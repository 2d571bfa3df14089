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
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from loadtests import compare_vllm as cv
from loadtests.benchmark import format_table

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

    def on_sigterm(*_):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_sigterm)
    levels: list[dict] = []
    try:
        for rnd in range(1, args.rounds + 1):
            order = [("beside_ray", beside), ("alone", alone)]
            if rnd % 2 == 0:
                order.reverse()
            for name, system in order:
                _say(f"round {rnd}/{args.rounds}: starting vllm {name}")
                try:
                    system.start(args.start_timeout_s)
                    levels += cv.measure(base_url, name, rnd, args)
                finally:
                    _say(f"round {rnd}/{args.rounds}: stopping vllm {name}")
                    system.stop()
    except KeyboardInterrupt:
        _say("interrupted: everything stopped")
        return 130
    finally:
        alone.stop()
        beside.stop()

    ratios = cv.ratios(levels, args.concurrency, a="beside_ray", b="alone")
    print(format_table(levels))
    print(f"{'c':>4}  {'out tok/s beside Ray':>20}  {'alone':>8}  {'ratio':>6}  {'TTFT p50 ms beside':>18}  {'alone':>8}  {'ratio':>6}")
    for c in args.concurrency:
        r = ratios[f"c{c}"]
        f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        print(
            f"{c:>4}  {f(r['beside_ray_output_tput']):>20}  {f(r['alone_output_tput']):>8}  "
            f"{f(r['output_tput_beside_ray_over_alone'], 2):>6}  {f(r['beside_ray_ttft_p50']):>18}  "
            f"{f(r['alone_ttft_p50']):>8}  {f(r['ttft_p50_beside_ray_over_alone'], 2):>6}"
        )
    print("CPU ms per 1000 output tokens, by process role (last round of each variant and level):")
    for lvl in levels:
        if lvl["round"] == args.rounds:
            top = sorted(lvl["cpu_ms_per_1k_output_tokens"].items(), key=lambda kv: -kv[1])
            print(f"  {lvl['system']} c={lvl['concurrency']}: " + ", ".join(f"{k} {v:.0f}" for k, v in top))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "levels": levels, "ratios": ratios}, indent=2))
    _say(f"stored {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
