"""The worker's decode of fetched KV blocks (``kv_codec.decode_kv_blocks``: check each
header against what was worked out once, copy each payload with numpy into its place in
one span with room behind it) against the form it had before (each block's checks set up
anew, one ``torch.frombuffer(...).copy_`` a block), alternated call by call in one process.

    python -m loadtests.kv_decode [--blocks 119] [--dtype float32] [--calls 40]

The blocks lie in one packed buffer, as a worker gets them from the data plane, and have
the shape of one block of the ``small`` preset (4 layers, 8 KV heads, 16 tokens, head_dim
64: 256 KiB in float32); 119 of them are the ~1.9k-token prefix of a multi-turn session's
eighth turn. Run it with the glibc settings of a replica
(``serve_runtime.keep_freed_memory``: ``MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=4294967296``), or every fresh span also pays its page faults.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time


def _torch_per_block(blocks, *, dtype, shape, out):
    """The form before: each block's checks set up anew (its expected size from a
    scalar tensor), then one frombuffer and copy_ a block."""
    import warnings

    import torch

    from deployments.compute.engines.kv_codec import _Expected

    block_size = shape[3]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for i, data in enumerate(blocks):
            torch.empty((), dtype=dtype).element_size()
            payload = _Expected(dtype, shape).payload(data, False)
            block = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
            out.narrow(3, i * block_size, block_size).copy_(block)
    return out


def alternate_calls(fns: dict, calls: int, *, setup=None, check=None, progress: str = "") -> dict[str, list[float]]:
    """Milliseconds of each ``fns[name](**setup())`` per call, the functions alternated
    call by call (``setup``, untimed, makes fresh keyword arguments for each call);
    ``check(name, result)`` on the first call's results; with ``progress``, a line on
    stderr every 10 calls. Also what ``loadtests.export_encode`` runs."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for call in range(calls):
        for name, fn in fns.items():
            kwargs = setup() if setup is not None else {}
            started = time.perf_counter()
            got = fn(**kwargs)
            times[name].append((time.perf_counter() - started) * 1000)
            if call == 0 and check is not None:
                check(name, got)
            del got
        if progress and (call + 1) % 10 == 0:
            print(f"[{progress}] {call + 1}/{calls} calls", file=sys.stderr, flush=True)
    return times


def print_medians(times: dict[str, list[float]], calls: int, before: str, after: str) -> None:
    """Each function's median and minimum (ms), then ``before``'s median over ``after``'s."""
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:17s} median {medians[name]:.2f} ms, min {min(ts):.2f} ms ({calls} calls)")
    print(f"{before} / {after}: {medians[before] / medians[after]:.2f}x")


def codec_bench_args(description: str, argv, *, blocks: int, calls: int):
    """The options of this and ``loadtests.export_encode`` (``--blocks``, ``--dtype``,
    ``--calls``), parsed; torch on one thread, as the engines run here
    (``engine.num_threads``). The arguments, and the torch dtype they name."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--blocks", type=int, default=blocks)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--calls", type=int, default=calls)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    return args, getattr(torch, args.dtype)


def main(argv=None) -> None:
    args, dtype = codec_bench_args(__doc__.splitlines()[0], argv, blocks=119, calls=40)

    import torch

    from deployments.compute.engines.kv_buffer import empty_with_room
    from deployments.compute.engines.kv_codec import _SAME_WIDTH_INT, decode_kv_blocks, encode_kv_blocks
    from deployments.dataplane.blocks import pack_blocks, unpack_blocks

    shape = (4, 2, 8, 16, 64)
    span_shape = (4, 2, 8, 16 * args.blocks, 64)
    print(f"[kv-decode] encoding {args.blocks} blocks of {list(shape)} {args.dtype}", file=sys.stderr, flush=True)
    source = torch.randn(span_shape).to(dtype)
    blocks = unpack_blocks(*pack_blocks(encode_kv_blocks(source, 16)))
    same_width = _SAME_WIDTH_INT[dtype.itemsize][0]

    def check(name, got):
        assert torch.equal(got.view(same_width), source.view(same_width)), name

    times = alternate_calls(
        {name: functools.partial(fn, blocks, dtype=dtype, shape=shape)
         for name, fn in (("decode_kv_blocks", decode_kv_blocks), ("torch_per_block", _torch_per_block))},
        args.calls,
        setup=lambda: {"out": empty_with_room(list(span_shape), 256, dtype=dtype)},
        check=check,
    )
    print_medians(times, args.calls, "torch_per_block", "decode_kv_blocks")

if __name__ == "__main__":
    main()
