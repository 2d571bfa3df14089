"""Torch tensors ⇄ stored KV blocks (the codec of ``deployments/dataplane/blocks.py``).

One block is the K/V of ``block_size`` consecutive tokens for every layer, as one tensor of
shape ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` (``2`` = keys, values) in the
model's dtype, C-contiguous, layout ``"layers,kv,heads,tokens,head_dim"``. A run of blocks
is handled as one "span" tensor ``[num_layers, 2, num_kv_heads, n * block_size, head_dim]``.

Decoding checks the header's dtype, shape and layout against what the model expects and
raises :class:`CorruptBlockError` on any mismatch, so a block from another model, dtype or
block size is a miss, never wrong output.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from deployments.dataplane.blocks import (
    DEFAULT_LAYOUT,
    BlockHeader,
    CorruptBlockError,
    checksum_of,
    decode_block,
    encode_block,
    encode_header_into,
    header_reserve,
)

__all__ = [
    "CorruptBlockError",
    "LAYOUT",
    "block_shape",
    "decode_kv_block",
    "decode_kv_blocks",
    "dtype_name",
    "encode_kv_block",
    "encode_kv_blocks",
]

LAYOUT = DEFAULT_LAYOUT  # "layers,kv,heads,tokens,head_dim"

_NAME_TO_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_TO_NAME = {v: k for k, v in _NAME_TO_DTYPE.items()}
_TOKENS_DIM = 3
# Per element size, a torch and a numpy integer type of that width: the decode copies
# blocks as raw elements of the model's dtype.
_SAME_WIDTH_INT = {4: (torch.int32, np.int32), 2: (torch.int16, np.int16)}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None


def block_shape(config, block_size: int) -> tuple[int, int, int, int, int]:
    """The shape of one block of a model with this (transformers) config."""
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return (int(config.num_hidden_layers), 2, num_kv_heads, int(block_size), int(head_dim))


def encode_kv_block(block: torch.Tensor) -> bytes:
    """One ``[layers, 2, heads, block_size, head_dim]`` tensor → stored bytes."""
    if block.dim() != 5 or block.shape[1] != 2:
        raise ValueError(f"a KV block must be [layers, 2, heads, tokens, head_dim], got {tuple(block.shape)}")
    header = BlockHeader(dtype=dtype_name(block.dtype), shape=tuple(block.shape), layout=LAYOUT)
    raw = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return encode_block(header, raw.numpy().tobytes())


def encode_kv_blocks(span: torch.Tensor, block_size: int) -> list[np.ndarray]:
    """A ``[layers, 2, heads, n * block_size, head_dim]`` span → n stored blocks, written
    into one buffer: the span copied once, straight into the blocks' payloads (a strided
    gather), then each payload's checksum and its header in front of it (padded to
    ``blocks.header_reserve``). Read-only uint8 arrays, one per block, viewing that
    buffer; each is what :func:`encode_kv_block` makes of that block, the header's padding
    aside. (One block at a time, through ``bytes``, took three copies: 32 MiB in 11-29 ms
    on a 2-core VM against 5-9 ms, ``loadtests/export_encode.py``.)"""
    num_tokens = span.shape[_TOKENS_DIM]
    if span.dim() != 5 or span.shape[1] != 2:
        raise ValueError(f"a KV span must be [layers, 2, heads, tokens, head_dim], got {tuple(span.shape)}")
    if num_tokens % block_size:
        raise ValueError(f"span of {num_tokens} tokens is not a whole number of {block_size}-token blocks")
    n = num_tokens // block_size
    if n == 0:
        return []
    span = span.detach().to("cpu")
    layers, _, heads, _, head_dim = span.shape
    shape = (int(layers), 2, int(heads), int(block_size), int(head_dim))
    header = BlockHeader(dtype=dtype_name(span.dtype), shape=shape, layout=LAYOUT)
    nbytes = layers * 2 * heads * block_size * head_dim * span.element_size()
    reserve = header_reserve(header, nbytes)  # a multiple of 64: payloads stay aligned
    stride = reserve + nbytes
    buf = np.empty(n * stride, dtype=np.uint8)
    rows = buf.reshape(n, stride)
    payloads = torch.from_numpy(rows[:, reserve:]).view(span.dtype).unflatten(1, shape)
    # [layers, 2, heads, n, block, head_dim] → [n, layers, 2, heads, block, head_dim]
    payloads.copy_(span.unflatten(_TOKENS_DIM, (n, block_size)).permute(3, 0, 1, 2, 4, 5))
    for row in rows:
        encode_header_into(row[:reserve], header, checksum_of(header, row[reserve:]), nbytes)
    rows.flags.writeable = False  # (views made from it after this are read-only too)
    return list(rows)


class _Expected:
    """What a block of one model must be (dtype, shape, layout, payload size), worked out
    once for all the blocks of a decode."""

    __slots__ = ("dtype", "shape", "nbytes")

    def __init__(self, dtype: torch.dtype, shape: Sequence[int]):
        self.dtype = dtype_name(dtype)
        self.shape = tuple(int(d) for d in shape)
        numel = 1
        for d in self.shape:
            numel *= d
        self.nbytes = numel * dtype.itemsize

    def payload(self, data: bytes | memoryview, verify: bool = True) -> memoryview:
        header, payload = decode_block(data, verify=verify)  # raises CorruptBlockError itself
        if header.dtype != self.dtype:
            raise CorruptBlockError(f"block dtype {header.dtype!r}, model wants {self.dtype!r}")
        if header.shape != self.shape:
            raise CorruptBlockError(f"block shape {list(header.shape)}, model wants {list(self.shape)}")
        if header.layout != LAYOUT:
            raise CorruptBlockError(f"block layout {header.layout!r}, expected {LAYOUT!r}")
        if len(payload) != self.nbytes:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, shape {list(self.shape)} needs {self.nbytes}")
        return payload


def _as_tensor(payload: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    # bytearray: a writable copy the tensor owns (torch warns on read-only buffers).
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def decode_kv_block(data: bytes | memoryview, *, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Stored bytes → one block tensor (on CPU). Raises CorruptBlockError if the bytes are
    damaged or are not a block of this ``dtype`` and ``shape``."""
    return _as_tensor(_Expected(dtype, shape).payload(data), dtype, shape)


def decode_kv_blocks(
    blocks: Sequence[bytes | memoryview],
    *,
    dtype: torch.dtype,
    shape: Sequence[int],
    verify: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """n stored blocks (in order) → one ``[layers, 2, heads, n * block_size, head_dim]`` span
    on CPU (``out``, if given: a CPU tensor of that shape and ``dtype``, written and
    returned). Raises CorruptBlockError if any block fails its checks (``verify=False``:
    the checksum is skipped, for blocks checked since they were written). Each payload is
    copied once, straight into the span."""
    if not blocks:
        raise ValueError("no blocks to decode")
    shape = tuple(int(d) for d in shape)
    block_size = shape[_TOKENS_DIM]
    span_shape = list(shape)
    span_shape[_TOKENS_DIM] = block_size * len(blocks)
    if out is None:
        span = torch.empty(span_shape, dtype=dtype)
    elif list(out.shape) != span_shape or out.dtype != dtype or out.device.type != "cpu":
        raise ValueError(f"out is {out.dtype} {list(out.shape)} on {out.device}, need {dtype} {span_shape} on cpu")
    else:
        span = out
    # The checks are worked out once; each payload is copied by numpy into its place in
    # the span, through integer views of the same width (numpy has no bfloat16; the copy
    # is bit-exact either way), with less per-call cost than a torch frombuffer and copy_
    # a block: 1.1-1.2x (float32) and 1.3x (bfloat16) for 119 blocks of 256 KiB on 2
    # cores, `python -m loadtests.kv_decode`.
    same_width = _SAME_WIDTH_INT[dtype.itemsize]
    dst = span.view(same_width[0]).unflatten(_TOKENS_DIM, (len(blocks), block_size)).numpy()
    expected = _Expected(dtype, shape)
    for i, data in enumerate(blocks):
        payload = expected.payload(data, verify)
        dst[:, :, :, i] = np.frombuffer(payload, dtype=same_width[1]).reshape(shape)
    return span
