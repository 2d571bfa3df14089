"""The torch worker's encode of an export (``kv_codec.encode_kv_blocks``: the span copied
once into the payloads of one buffer, checksums, headers written in front) against the
form it had before (``encode_kv_block`` a block at a time: a contiguous copy, ``tobytes``,
then ``b"".join`` with the header: three copies), alternated call by call in one process.

    python -m loadtests.export_encode [--blocks 128] [--dtype float32] [--calls 30]

The span has the shape of the ``small`` preset's KV (4 layers, 8 KV heads, head_dim 64;
blocks of 16 tokens, 256 KiB in float32) and is a slice of a longer cache (not
contiguous), as an export's is. Run it with the glibc settings of a replica too
(``serve_runtime.keep_freed_memory``: ``MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=4294967296``): without them every fresh buffer pays its page faults,
which is what a worker without those settings pays.
"""

from __future__ import annotations

import functools
import sys

from loadtests.kv_decode import alternate_calls, codec_bench_args, print_medians


def _per_block(span, block_size: int) -> list:
    """The form before 2026-12-06: one ``encode_kv_block`` (bytes) a block."""
    from deployments.compute.engines.kv_codec import _TOKENS_DIM, encode_kv_block

    span = span.detach().to("cpu")
    return [
        encode_kv_block(span.narrow(_TOKENS_DIM, start, block_size))
        for start in range(0, span.shape[_TOKENS_DIM], block_size)
    ]


def main(argv=None) -> None:
    args, dtype = codec_bench_args(__doc__.splitlines()[0], argv, blocks=128, calls=30)

    import torch

    from deployments.compute.engines.kv_codec import encode_kv_blocks
    from deployments.dataplane.blocks import decode_block

    block_size = 16
    tokens = block_size * args.blocks
    cache = torch.randn(4, 2, 8, tokens + 64, 64).to(dtype)
    span = cache.narrow(3, 32, tokens)
    mib = tokens * 4 * 2 * 8 * 64 * dtype.itemsize / 2**20
    print(f"[export-encode] {args.blocks} blocks ({mib:.0f} MiB of {args.dtype}), {args.calls} calls each",
          file=sys.stderr, flush=True)
    last = bytes(decode_block(_per_block(span.narrow(3, tokens - block_size, block_size), block_size)[0])[1])

    def check(name, blocks):  # the same headers and payloads either way
        assert len(blocks) == args.blocks, name
        assert bytes(decode_block(blocks[-1])[1]) == last, name

    times = alternate_calls(
        {"encode_kv_blocks": functools.partial(encode_kv_blocks, span, block_size),
         "per_block": functools.partial(_per_block, span, block_size)},
        args.calls, check=check, progress="export-encode",
    )
    print_medians(times, args.calls, "per_block", "encode_kv_blocks")

if __name__ == "__main__":
    main()
