"""Our app (vLLM engine, tiny model) behind Serve's gRPC-streaming Python proxy (what
``app.builder.SERVE_PROCESS_ENV`` sets up) versus behind Ray Serve's HAProxy ingress
(``--ingress haproxy``: a C proxy, HTTP served by the ingress replica itself),
alternated per round; output-token throughput and TTFT at each concurrency.

    python -m loadtests.proxy_modes [--rounds 2] [--concurrency 1,8,32]

The proxy mode is fixed when Ray starts, so each (mode, round) runs in its own process that
starts Ray, deploys ``loadtests.compare_vllm``'s app, measures with ``run_level`` (same
load as compare_vllm) and stops everything. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.benchmark import write_report

MODES = ("grpc_proxy", "haproxy")


def _say(msg: str) -> None:
    print(f"[proxy_modes] {msg}", file=sys.stderr, flush=True)


def run_one(mode: str, rnd: int, out: str, args) -> None:
    from loadtests import compare_vllm as cv

    model_path = Path(args.model_dir).resolve()
    ns = argparse.Namespace(
        max_num_seqs=32, kv_gib=1.0, output_len=args.output_len, input_len=args.input_len, seed=0,
        concurrency=args.concurrency, min_prompts=16, prompts_per_slot=4,
        vocab_size=json.loads((model_path / "config.json").read_text())["vocab_size"],
        ingress="haproxy" if mode == "haproxy" else "serve-proxy",
    )
    app = cv.OurApp(model_path, ns, args.port)
    try:
        app.start(600)
        levels = cv.measure(f"http://127.0.0.1:{args.port}", mode, rnd, ns)
    finally:
        app.stop()
    Path(out).write_text(json.dumps(levels))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.proxy_modes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model-dir", default="models/tiny")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--out", default="loadtests/results/proxy_modes.json")
    p.add_argument("--one", nargs=3, metavar=("MODE", "ROUND", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.one:
        mode, rnd, out = args.one
        run_one(mode, int(rnd), out, args)
        return 0

    from app.model_builder import ensure_model

    ensure_model(Path(args.model_dir), "tiny")
    levels: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, args.rounds + 1):
            for mode in MODES:
                _say(f"round {rnd}/{args.rounds}: {mode}")
                out = os.path.join(tmp, f"{mode}_{rnd}.json")
                cmd = [sys.executable, "-m", "loadtests.proxy_modes", "--one", mode, str(rnd), out,
                       "--concurrency", ",".join(map(str, args.concurrency)), "--model-dir", args.model_dir,
                       "--port", str(args.port), "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
                subprocess.run(cmd, check=True)
                levels += json.loads(Path(out).read_text())

    from loadtests.compare_vllm import ratios as median_ratios

    ratios = median_ratios(levels, args.concurrency, "haproxy", "grpc_proxy")
    print(f"{'c':>4} {'mode':>12} {'out tok/s':>10} {'TTFT p50 ms':>12}")
    for c in args.concurrency:
        row = ratios[f"c{c}"]
        for mode in MODES:
            print(f"{c:>4} {mode:>12} {row[f'{mode}_output_tput']:>10.1f} {row[f'{mode}_ttft_p50']:>12.1f}")
    print(json.dumps(ratios, indent=2))
    _say(f"stored {write_report(args.out, {'levels': levels, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
