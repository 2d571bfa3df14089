"""The torch engine's two ways to run a Llama: its own model (``engines/llama.py``) against
transformers' ``LlamaForCausalLM``, side by side on one checkpoint.

    python -m loadtests.torch_model_impl [--preset small] [--rounds 3] [--num-threads 1]
        [--out loadtests/results/torch_model_impl.json]

* ``start``: a fresh Python process imports the engine, constructs it and starts it (loads
  the weights, one warm-up forward), as a ComputeWorker replica's engine phase does; the
  wall time of each process, native and transformers alternated per round.
* ``steps``: in one process, both engines' models on the same inputs, alternated per
  round: a prefill of 128 and of 2048 tokens (batch 1), and a decode step at batch 1 and 8
  over a 1024-token cache (the engine's own cache layers, as in serving). The median per
  round, in ms. The logits are compared too (they should be equal).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtests.benchmark import write_report

IMPLS = ("native", "transformers")
START_CODE = (
    "import asyncio, sys, time\n"
    "t = time.perf_counter()\n"
    "from deployments.compute.engines.torch_engine import TorchEngine\n"
    "e = TorchEngine(sys.argv[1], model_impl=sys.argv[2], num_threads=int(sys.argv[3]))\n"
    "asyncio.run(e.start())\n"
    "print(time.perf_counter() - t)\n"
)


def _say(msg: str) -> None:
    print(f"[torch-model-impl] {msg}", file=sys.stderr, flush=True)


def start_seconds(model_path: Path, impl: str, num_threads: int) -> tuple[float, float]:
    """(wall seconds of the whole process, seconds from its first import to a started engine)."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", START_CODE, str(model_path), impl, str(num_threads)],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
    )
    return time.perf_counter() - started, float(out.stdout.strip().splitlines()[-1])


def step_timings(models: dict, num_layers: int, vocab: int, reps: int) -> dict:
    import torch

    from deployments.compute.engines.kv_buffer import growable_cache

    g = torch.Generator().manual_seed(0)
    cases = {}
    for n in (128, 2048):
        ids = torch.randint(1, vocab, (1, n), generator=g)
        cases[f"prefill_{n}"] = (ids, None)
    ctx = torch.randint(1, vocab, (8, 1024), generator=g)
    for b in (1, 8):
        cases[f"decode_b{b}_1k"] = (ctx[:b], torch.randint(1, vocab, (b, 1), generator=g))
    out: dict[str, dict[str, float]] = {}
    logits: dict[str, dict[str, torch.Tensor]] = {}
    with torch.inference_mode():
        for case, (ids, nxt) in cases.items():
            for impl, model in models.items():
                hf = impl == "transformers"
                times = []
                for _ in range(reps):
                    b, n = ids.shape
                    cache = growable_cache(num_layers, hf=hf)
                    mask = torch.ones(b, n, dtype=torch.long)
                    kw = dict(attention_mask=mask, position_ids=torch.arange(n)[None].expand(b, -1),
                              past_key_values=cache, use_cache=True, logits_to_keep=1)
                    if nxt is None:
                        t = time.perf_counter()
                        result = model(input_ids=ids, **kw).logits
                        times.append(time.perf_counter() - t)
                        continue
                    model(input_ids=ids, **kw)
                    t = time.perf_counter()
                    result = model(input_ids=nxt, attention_mask=torch.ones(b, n + 1, dtype=torch.long),
                                   position_ids=torch.full((b, 1), n), past_key_values=cache, use_cache=True).logits
                    times.append(time.perf_counter() - t)
                out.setdefault(case, {})[impl] = statistics.median(times) * 1000
                logits.setdefault(case, {})[impl] = result
    equal = {case: bool(torch.equal(v["native"], v["transformers"])) for case, v in logits.items()}
    return {"ms": out, "logits_equal": equal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.torch_model_impl")
    p.add_argument("--preset", default="small")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="forward passes per case per round (median)")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--out", default="loadtests/results/torch_model_impl.json")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from app.model_builder import ensure_model
    from deployments.compute.engines.llama import LlamaForCausalLM

    torch.set_num_threads(args.num_threads)
    model_path = ensure_model(Path(f"models/{args.preset}"), args.preset, quiet=False)
    rounds = []
    models = {
        "native": LlamaForCausalLM.from_pretrained(model_path),
        "transformers": AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(),
    }
    num_layers, vocab = models["native"].config.num_hidden_layers, models["native"].config.vocab_size
    for r in range(args.rounds):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        start = {}
        for impl in order:
            wall, inner = start_seconds(model_path, impl, args.num_threads)
            start[impl] = {"process_s": round(wall, 2), "import_to_started_s": round(inner, 2)}
        steps = step_timings(dict((i, models[i]) for i in order), num_layers, vocab, args.reps)
        rounds.append({"start": start, **steps})
        _say(f"round {r + 1}/{args.rounds}: start {start}")
        for case, ms in steps["ms"].items():
            _say(f"  {case}: native {ms['native']:.2f} ms, transformers {ms['transformers']:.2f} ms "
                 f"(ratio {ms['transformers'] / ms['native']:.2f}), logits equal {steps['logits_equal'][case]}")
    _say(f"stored {write_report(args.out, {'args': vars(args), 'rounds': rounds})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
