"""Where one turn's time goes inside the torch engine: torch.profiler over a second turn
whose prefix is imported (load, decode, copy to the device, prefill of the suffix) and its
decode steps, on whatever device the engine picks, with no Serve, Ray or Redis in the way.

    python -m loadtests.engine_profile [--preset medium] [--dtype bfloat16] [--context 1024]
        [--reply-tokens 32] [--rows 25] [--out DIR]

Why: ``loadtests/engine_kv.py`` on an H200 saw the medium preset in bf16 import a prefix in
0.95-1.7 s where fp32 took ~0.1 s, and its decode steps run ~10x slower than fp32's; the
per-turn figures say how long, this says in which operators (there: SDPA's cuDNN backend,
which the engine now turns off; loadtests/README.md, "The torch engine on an H200 again").
The warm-up repeats the profiled turn's shapes, so costs paid once per new shape (such as
cuDNN's graph builds) do not show here: compare with ``engine_kv``'s per-turn figures. The engine's own DEBUG line
``kv prefix fetched`` splits the import into load and decode; the profile tables (top
operators by self CPU time, and by device time on CUDA) go to stdout, and with ``--out`` a
Chrome trace (``trace_<dtype>.json``) goes there too.

Turn 1 prefills ``--context`` tokens and exports their blocks to an in-memory store of
encoded blocks (what the data plane hands a worker); turn 2 repeats that context plus a
few new tokens with ``always_fetch`` (no fetch-or-recompute decision), so its prefix is
imported, then decodes ``--reply-tokens`` tokens. A warm-up turn of the same shape runs
first so that kernels, the allocator and the first import are not in the profile.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from pathlib import Path

from loadtests.engine_kv import add_engine_arguments


def _say(msg: str) -> None:
    print(f"[engine-profile] {msg}", file=sys.stderr, flush=True)


async def run(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from deployments.compute.engines.torch_engine import TorchEngine
    from loadtests.engine_kv import ensure_preset_model, turn
    from tests.fixtures.kv import DictKVConnector

    model_path = ensure_preset_model(args, _say)
    store = DictKVConnector(args.block_size)
    engine = TorchEngine(str(model_path), max_num_seqs=4, dtype=args.dtype, device=args.device,
                         num_threads=args.num_threads, model_id=f"profile-{args.preset}",
                         block_size=args.block_size, kv_connector=store, always_fetch=True)
    await engine.start()
    cuda = engine.device.type == "cuda"
    _say(f"device {engine.device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), dtype {args.dtype}")
    vocab = engine.config.vocab_size
    rng = random.Random(7)

    def tokens(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    warm = tokens(args.context)
    await turn(engine, "warm-1", warm, 1)
    await turn(engine, "warm-2", warm + tokens(args.new_tokens), args.reply_tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # The first turn (prefill + export) is outside the profile: it is the second turn's
    # import and decode that is asked about.
    context = tokens(args.context)
    await turn(engine, "p-1", context, 1)
    prompt = context + tokens(args.new_tokens)
    before = engine.kv_stats()
    try:  # the engine's loop and its decode threads, not only this one (torch >= 2.8)
        extra = dict(experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))
    except (AttributeError, TypeError):
        extra = {}
        _say("this torch profiles the calling thread only: the engine loop's operators are missing")
    with profile(activities=activities, record_shapes=False, **extra) as prof:
        started = time.perf_counter()
        ttft, tpot, out = await turn(engine, "p-2", prompt, args.reply_tokens)
        wall = time.perf_counter() - started
    after = engine.kv_stats()
    await engine.shutdown()
    imported = after.prefix_hit_tokens - before.prefix_hit_tokens
    print(f"turn 2: {len(prompt)} prompt tokens, {imported} imported, TTFT {1000 * ttft:.1f} ms, "
          f"{1000 * tpot:.2f} ms per output token over {len(out)} tokens, {1000 * wall:.1f} ms in all; "
          f"import rate {engine.import_bytes_per_s('L2') or 0:.3g} B/s")
    averages = prof.key_averages()
    print("\n== by self CPU time ==")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print("\n== by self device time ==")
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        trace = Path(args.out) / f"trace_{args.preset}_{args.dtype}.json"
        prof.export_chrome_trace(str(trace))
        _say(f"trace at {trace}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.engine_profile")
    add_engine_arguments(p, preset="medium", dtype="bfloat16")
    p.add_argument("--context", type=int, default=1024, help="tokens of turn 1, imported by turn 2")
    p.add_argument("--new-tokens", type=int, default=85, help="turn 2's new tokens after the context")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", default=None, help="folder for a Chrome trace of the profiled turn")
    p.add_argument("--log-level", default="DEBUG", help="the engine's log level (DEBUG: its import lines)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ray.serve").setLevel(args.log_level)  # the engine logs to the replica's Serve log
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
