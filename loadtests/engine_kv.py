"""KV reuse inside the torch engine alone: TTFT per turn of a growing conversation with the
prefix imported versus recomputed, on whatever device the engine picks (CUDA when there is
one, else the CPU), with no Serve, Ray or Redis in the way.

    python -m loadtests.engine_kv [--preset small] [--dtype float32] [--turns 8]
        [--turn-tokens 85] [--reply-tokens 180] [--rounds 2] [--kv-arena-bytes N] [--out FILE]

What it isolates: ``loadtests/multiturn.py`` measures the whole application (HTTP, Serve
hops, the data plane, Redis); this measures what the engine itself gains from a stored
prefix, the ceiling those layers eat into. Three engines on the same checkpoint, fed the
same conversations (token ids, greedy, ``ignore_eos``), alternated per conversation:

* ``recompute``: no KV connector; every turn prefills its whole context;
* ``import``: an in-memory store of *encoded* blocks (what the data plane hands a worker:
  bytes with header and checksum) and no L1, so each turn decodes and checks the stored
  blocks, copies them to the device and prefills only its new tokens;
* ``l1``: the same plus the engine's own prefix cache (``prefix_cache_bytes``): decoded
  tensors kept in host memory, copied to the device each turn;
* ``auto``: as ``l1``, but with the engine's fetch-or-recompute decision on, as deployed.

``import`` and ``l1`` import every stored prefix (``always_fetch``), so both sides of the
decision are measured rather than chosen; ``auto`` should track the faster of ``recompute``
and ``l1`` turn by turn (it imports now and then to re-measure). The report gives the
engine's measured prefill speed and import rates, what the decision compares. Greedy outputs of ``import`` and ``l1`` are compared with
``recompute`` token for token (fp32: equal; bf16/fp16: reported, not required).

On a CPU the engines' KV buffers come from a KV arena as a deployed worker's do
(``engine.kv_arena_bytes``, the config's default; ``--kv-arena-bytes 0``: malloc, whose
fresh pages fault on first write and on some days cost more than the import itself).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtests.benchmark import write_report

MODES = ("recompute", "import", "l1", "auto")


def _say(msg: str) -> None:
    print(f"[engine-kv] {msg}", file=sys.stderr, flush=True)


async def turn(engine, request_id: str, prompt: list[int], reply_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT and time per output token after the first, in seconds; the generated tokens)
    of one greedy request."""
    from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

    req = GenerationRequest(
        request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=reply_tokens, ignore_eos=True)
    )
    start = time.perf_counter()
    ttft, out = None, []
    async for delta in engine.generate(req):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - start
        out.extend(delta.token_ids)
    tpot = (time.perf_counter() - start - ttft) / max(1, len(out) - 1)
    await engine.wait_for_kv_exports()  # a person's think time covers the export
    return ttft, tpot, out


def ensure_preset_model(args, say=_say) -> Path:
    """The checkpoint of ``--preset`` (``--model-dir``, else ``models/`` for the presets the
    tests build, a temp dir for the larger ones), built if missing."""
    from app.model_builder import ensure_model

    model_dir = Path(args.model_dir or (Path(tempfile.gettempdir()) / f"engine-kv-{args.preset}"
                                        if args.preset not in ("tiny", "small") else f"models/{args.preset}"))
    say(f"model: preset {args.preset} at {model_dir} (built if missing)")
    return ensure_model(model_dir, args.preset, quiet=False)


def add_engine_arguments(p: argparse.ArgumentParser, *, preset: str, dtype: str) -> None:
    """The engine's command-line options this benchmark and ``loadtests.engine_profile``
    share."""
    p.add_argument("--preset", default=preset)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=2)


async def run(args) -> dict:
    import torch

    from deployments.compute.engines import kv_arena
    from deployments.compute.engines.torch_engine import TorchEngine
    from tests.fixtures.kv import DictKVConnector

    model_path = ensure_preset_model(args)
    common = dict(max_num_seqs=4, dtype=args.dtype, num_threads=args.num_threads, model_id=f"bench-{args.preset}",
                  block_size=args.block_size, device=args.device, kv_arena_bytes=args.kv_arena_bytes,
                  cudnn_attention=args.cudnn_attention)
    stores = {m: DictKVConnector(args.block_size) for m in ("import", "l1", "auto")}
    engines = {
        "recompute": TorchEngine(str(model_path), **common),
        "import": TorchEngine(str(model_path), kv_connector=stores["import"], always_fetch=True, **common),
        "l1": TorchEngine(str(model_path), kv_connector=stores["l1"], always_fetch=True,
                          prefix_cache_bytes=args.l1_bytes, **common),
        "auto": TorchEngine(str(model_path), kv_connector=stores["auto"], prefix_cache_bytes=args.l1_bytes, **common),
    }
    # KV buffers from an arena, as a deployed worker's (engine.kv_arena_bytes): the four
    # engines share this process's one arena, so it gets room for each (on a CPU; else 0).
    arena_bytes = sum(e.kv_arena_bytes for e in engines.values())
    if arena_bytes:
        kv_arena.install(arena_bytes, background=False)
        _say(f"KV arena: {arena_bytes >> 20} MiB for the {len(engines)} engines")
    for e in engines.values():
        await e.start()
    device = str(engines["recompute"].device)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    _say(f"device {device} ({name}), dtype {args.dtype}")
    vocab = engines["recompute"].config.vocab_size
    for e in engines.values():  # warm-up: kernels, allocator, one import and one export
        for i in range(2):
            await turn(e, f"warm-{i}", list(range(5, 5 + 3 * args.block_size)), 4)

    ttfts = {m: [[] for _ in range(args.turns)] for m in MODES}
    tpots = {m: [[] for _ in range(args.turns)] for m in MODES}
    mismatched = {m: 0 for m in MODES}
    for rnd in range(args.rounds):
        rng = random.Random(1000 + rnd)
        order = list(MODES) if rnd % 2 == 0 else list(reversed(MODES))
        # The same conversation for every mode; each mode's store starts empty for it.
        turns = [[rng.randrange(8, vocab) for _ in range(args.turn_tokens)] for _ in range(args.turns)]
        contexts = {m: [] for m in MODES}
        replies = {m: [] for m in MODES}
        for t in range(args.turns):
            for m in order:
                e = engines[m]
                prompt = contexts[m] + turns[t]
                ttft, tpot, out = await turn(e, f"r{rnd}-t{t}-{m}", prompt, args.reply_tokens)
                ttfts[m][t].append(ttft)
                tpots[m][t].append(tpot)
                replies[m].append(out)
                contexts[m] = prompt + out
            _say(f"round {rnd + 1} turn {t + 1} (context {len(contexts['recompute'])} tokens): " + ", ".join(
                f"{m} {1000 * ttfts[m][t][-1]:.1f} ms" for m in MODES))
        for m in ("import", "l1", "auto"):
            mismatched[m] += sum(a != b for a, b in zip(replies[m], replies["recompute"]))
        for store in stores.values():
            store.clear()
    stats = {m: e.kv_stats() for m, e in engines.items()}
    prefill_speed = engines["recompute"].prefill_tokens_per_s()
    prefill_by_mode = {m: e.prefill_tokens_per_s() for m, e in engines.items()}
    prefill_fixed_by_mode = {m: e.prefill_fixed_seconds() for m, e in engines.items()}
    import_rates = {m: {t: engines[m].import_bytes_per_s(t) for t in ("L1", "L2")} for m in ("import", "l1", "auto")}
    for e in engines.values():
        await e.shutdown()

    per_turn = {m: [1000 * statistics.median(v) for v in ttfts[m]] for m in MODES}
    late = range(3, args.turns)
    ratios = {
        f"recompute_over_{m}_turns_ge4": statistics.median(per_turn["recompute"][t] / per_turn[m][t] for t in late)
        for m in ("import", "l1", "auto")
    }
    return {
        "device": device,
        "device_name": name,
        "dtype": args.dtype,
        # Whether SDPA could pick cuDNN attention (CUDA only; see --cudnn-attention).
        "sdpa_cudnn": device.startswith("cuda") and torch.backends.cuda.cudnn_sdp_enabled(),
        "preset": args.preset,
        "ttft_ms_by_turn": per_turn,
        # Decode speed at each turn's context length (the replies are the same length).
        "tpot_ms_by_turn": {m: [1000 * statistics.median(v) for v in tpots[m]] for m in MODES},
        "ratios": ratios,
        "replies_differing_from_recompute": mismatched,
        "replies_compared": args.rounds * args.turns,
        "prefill_tokens_per_s": prefill_speed,
        # What each engine's decision would use, fitted to its own prefills (in "auto",
        # mostly the short suffixes after an import): marginal speed and fixed cost.
        "prefill_tokens_per_s_by_mode": prefill_by_mode,
        "prefill_fixed_seconds_by_mode": prefill_fixed_by_mode,
        "import_bytes_per_s": import_rates,
        "kv_stats": {m: dataclasses.asdict(s) for m, s in stats.items()},
        # The process's one arena (the engines share it): buffers it had no room for
        # came from malloc, and may have faulted.
        "kv_arena": {
            "capacity_bytes": stats["recompute"].arena_capacity_bytes,
            "fallbacks": stats["recompute"].arena_fallbacks,
        },
    }


def main(argv=None) -> int:
    from app.config import EngineConfig

    p = argparse.ArgumentParser(prog="python -m loadtests.engine_kv")
    add_engine_arguments(p, preset="small", dtype="float32")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=85)
    p.add_argument("--reply-tokens", type=int, default=180)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--l1-bytes", type=int, default=4 << 30)
    p.add_argument(
        "--kv-arena-bytes", type=int, default=EngineConfig().kv_arena_bytes,
        help="engine.kv_arena_bytes of each engine (default: the config's); 0: KV buffers from malloc",
    )
    p.add_argument("--cudnn-attention", action="store_true",
                   help="on CUDA, leave SDPA's cuDNN backend on (the engine turns it off: per-shape graph builds)")
    p.add_argument("--out", default="loadtests/results/engine_kv.json")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    print("turn  " + "".join(f"{m:>12}" for m in MODES) + "   (median TTFT, ms)")
    for t in range(args.turns):
        print(f"{t + 1:>4}  " + "".join(f"{report['ttft_ms_by_turn'][m][t]:>12.1f}" for m in MODES))
    print("turn  " + "".join(f"{m:>12}" for m in MODES) + "   (median time per output token, ms)")
    for t in range(args.turns):
        print(f"{t + 1:>4}  " + "".join(f"{report['tpot_ms_by_turn'][m][t]:>12.2f}" for m in MODES))
    print(json.dumps({k: report[k] for k in ("device_name", "dtype", "sdpa_cudnn", "ratios", "replies_differing_from_recompute",
                                             "prefill_tokens_per_s", "prefill_tokens_per_s_by_mode",
                                             "prefill_fixed_seconds_by_mode", "import_bytes_per_s", "kv_arena")}, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), **report})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
