"""What running on Ray costs plain vLLM on this machine: the same ``vllm serve`` and load as
``compare_vllm``, alone and next to an idle Ray cluster with Serve (its controller, HTTP
proxy, HAProxy ingress and one trivial deployment, as ``llm-serve run`` by default
starts them, without our app), alternated in each round.

    python -m loadtests.ray_background [--rounds 2] [--concurrency 1,8,32] [--out FILE.json]
    python -m loadtests.ray_background --paired 8 [--concurrency 1,8,32]

Neither variant runs any of our code in the request path: whatever separates them is the
CPU Ray's own processes take from vLLM's on the same cores. ``compare_vllm`` measures our
app, which pays that on top of its own work; this is the floor under its ratio. Printed and
stored: the table of levels, the ratios (beside Ray / alone) of output tokens/s and TTFT
p50 per concurrency, and the CPU per 1000 output tokens by process role. Loopback only.

``--paired N``: one vLLM server and one idle Ray, both started once; the slices alternate
between vLLM with Ray's processes frozen (SIGSTOP, ``loadtests.paired``: "alone") and
with them running ("beside_ray"), N back-to-back pairs per concurrency, the median of the
pairs' ratios with a 90% interval (see ``compare_vllm --paired``). The same server in
both halves: what separates them is only Ray's processes running.
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
        use_serve_process_env("haproxy")  # as `llm-serve run` by default (where HAProxy can start)
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


def paired(beside: VLLMBesideRay, base_url: str, args, measure_fn=None, ray_pids=None) -> list[dict]:
    """``--paired``: Ray (and Serve) and the vLLM server started once; then ``args.paired``
    pairs of slices per concurrency, vLLM measured with Ray's processes frozen ("alone")
    and running ("beside_ray"), the order flipped from one slice pair to the next. Returns
    the slices (levels with ``pair``; ``ray_cpu_s``: what Ray's processes used during the
    slice, ~0 when frozen). Everything is thawed and stopped at the end. ``measure_fn``,
    ``ray_pids`` (what to freeze; every process this one started but vLLM's by default):
    a test's stand-ins."""
    from loadtests.paired import Freezer, descendants, slice_schedule

    cv.interrupt_on_sigterm()
    slices: list[dict] = []
    ray_freezer = None
    try:
        _say("starting an idle Ray and Serve, then vLLM")
        beside.start(args.start_timeout_s)
        pgid = beside.vllm.proc.pid
        ray_freezer = Freezer("ray", ray_pids or (lambda: descendants([pgid])))
        for pair, c, name in slice_schedule(args.paired, args.concurrency, "beside_ray", "alone"):
            if name == "alone":
                ray_freezer.freeze()
            else:
                ray_freezer.thaw()
                time.sleep(args.settle_s)  # timers that came due while it was frozen
            level = (measure_fn or cv.measure_level)(
                base_url, name, pair, c, args, label=f"pair {pair}/{args.paired}", vllm_pgid=pgid
            )
            level["pair"] = pair
            cpu = level.get("cpu_seconds_by_role", {})
            level["ray_cpu_s"] = round(sum(v for r, v in cpu.items() if cv.is_ray_side_role(r)), 3)
            slices.append(level)
    finally:
        if ray_freezer is not None:
            ray_freezer.thaw()
        beside.stop()
    return slices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.ray_background")
    cv.add_load_options(p)
    p.add_argument(
        "--paired", type=int, default=0, metavar="N",
        help="one vLLM and one idle Ray, started once; N back-to-back pairs per concurrency "
        "of vLLM with Ray frozen and running (instead of --rounds)",
    )
    p.add_argument("--settle-s", type=float, default=1.0, help="--paired: seconds between thawing Ray and a slice")
    p.add_argument("--out", default="loadtests/results/ray_background.json")
    args = p.parse_args(argv)
    model_path = cv.prepare(args)
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.gettempdir()) / f"ray_background_vllm_{os.getpid()}.log"
    flags = cv.vllm_flags(model_path, args)
    alone = cv.VLLMServer(flags, args.port, log_path)
    beside = VLLMBesideRay(cv.VLLMServer(flags, args.port, log_path))
    _say(f"vllm flags: {' '.join(flags)} (server log: {log_path})")

    if args.paired:
        from loadtests.paired import pair_stats

        args.load_in_child = True  # see compare_vllm.run_level_in_child
        try:
            slices = paired(beside, base_url, args)
        except KeyboardInterrupt:
            _say("interrupted: everything stopped")
            return 130
        stats = pair_stats(slices, a="beside_ray", b="alone", key="output_throughput")
        ttft = pair_stats(slices, a="beside_ray", b="alone", key="p50_ttft_ms")
        print(format_table(slices))
        cv.print_pairs(
            stats, slices, args.concurrency, "beside_ray", "alone",
            title="vLLM's output tok/s beside a running idle Ray / with Ray frozen, per pair:",
        )
        print("TTFT p50 beside / alone, median of pairs: " + cv.median_ratios(ttft, args.concurrency))
        frozen_cpu = max((s["ray_cpu_s"] for s in slices if s["system"] == "alone"), default=0.0)
        print(f"most CPU Ray's processes used in an 'alone' slice (frozen): {frozen_cpu:.3f} s")
        cv.print_cpu_by_role(slices)
        doc = {"args": vars(args), "levels": slices, "pairs_output_tput": stats, "pairs_ttft_p50": ttft}
        _say(f"stored {write_report(args.out, doc)}")
        return 0

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
