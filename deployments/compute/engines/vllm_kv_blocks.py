"""The stored form of vLLM's KV blocks, apart from vLLM itself (``vllm_kv_connector.py``
uses it; no vLLM import here, so the tests of these rules run where vLLM cannot, on a GPU
machine among them: ``loadtests/gpu_check.sh``).

vLLM (0.32 on) hands a connector each attention layer's cache as a standardized per-layer
view of logical shape ``[num_blocks, heads, B, content]`` whatever its physical order in
memory (RFC #42082). What ``content`` holds differs by backend: the CPU backend reads a
block's ``[heads, B, 2*head_dim]`` as ``[heads, 2 (k, v), B, head_dim]``; the GPU ones
(FlashAttention, Triton, FlashInfer, FlexAttention) split each token's content into its
key and its value; MLA's content is one latent vector (``heads`` = 1); NVFP4 caches pack
K and V as separate head groups. A stored block is the interiors of one block in every
layer of this worker, stacked in layer order, ``[layers, heads, B, content]``, in logical
order (so the physical order of a cache never matters), and its header's ``layout`` names
what the bytes mean: the device kind and the cache's dtype setting. A block is only ever
loaded by an engine whose header is equal, so a CPU engine never reads a GPU one's blocks
as its own (same logical shape, other meaning): a mismatch is a miss.

Sharded engines: with tensor or pipeline parallelism each worker holds a part of every
block (its heads, its layers) under the same prompt hash, so each worker stores its part
under its own key (``rank_suffix``), never another worker's bytes with an equal header.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

# The single-device CPU backend's label (blocks stored before labels named devices
# carry it too).
CPU_LAYOUT = "vllm-cpu:layers,heads,kv,tokens,head_dim"


def block_layout(device_type: str, cache_dtype: str, shape: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """``(layout, header shape)`` of a stored block for per-layer caches of logical
    ``shape`` ``[num_blocks, heads, B, content]`` on ``device_type`` ("cpu", "cuda", ...)
    with vLLM's ``cache_dtype`` setting ("auto", "fp8", ...). Raises ValueError for a
    shape that is not such a view."""
    if len(shape) != 4 or min(shape) <= 0:
        raise ValueError(f"per-layer KV view {tuple(shape)} is not [num_blocks, heads, block_size, content]")
    _, heads, block_size, content = (int(d) for d in shape)
    if device_type == "cpu" and cache_dtype == "auto":
        if content % 2:
            raise ValueError(f"CPU KV content {content} is not 2 x head_dim")
        return CPU_LAYOUT, (heads, 2, block_size, content // 2)
    return f"vllm-{device_type}:{cache_dtype}:layers,heads,tokens,content", (heads, block_size, content)


def rank_suffix(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
    """What a worker appends to a block's hash to name its own part of the block: nothing
    for an engine on one device, else its tensor- and pipeline-parallel ranks."""
    if tp_size <= 1 and pp_size <= 1:
        return ""
    return f"@tp{tp_rank}of{tp_size}.pp{pp_rank}of{pp_size}"


# Most device memory one save or load stages at once: a transfer of more blocks goes in
# chunks (a block of a large model is megabytes: 80 layers x 64 KiB, and a long prompt
# saves hundreds of them; staged whole they would take gigabytes next to the KV cache).
STAGING_BYTES = 64 << 20


def _chunks(caches: Sequence[torch.Tensor], n: int, staging_bytes: int) -> range:
    per_block = len(caches) * caches[0][0].numel() * caches[0].element_size()
    step = max(1, staging_bytes // max(1, per_block))
    return range(0, n, step)


def gather_blocks(
    caches: Sequence[torch.Tensor], block_ids: Sequence[int], staging_bytes: int = STAGING_BYTES
) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer's cache as one contiguous host tensor
    ``[len(block_ids), layers, heads, B, content]``, copied off the device in chunks of at
    most ``staging_bytes``."""
    first = caches[0]
    ids = list(block_ids)
    out = torch.empty((len(ids), len(caches), *first.shape[1:]), dtype=first.dtype)
    chunks = _chunks(caches, len(ids), staging_bytes)
    for start in chunks:
        part = torch.tensor(ids[start : start + chunks.step], dtype=torch.long, device=first.device)
        out[start : start + len(part)].copy_(torch.stack([c.index_select(0, part) for c in caches], dim=1))
    return out


def block_bytes(blocks: torch.Tensor, i: int) -> bytes:
    """Block ``i`` of ``gather_blocks``' result, as the payload bytes of a stored block."""
    return blocks[i].view(torch.uint8).numpy().tobytes()


def scatter_blocks(
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    payloads: Sequence[bytes],
    staging_bytes: int = STAGING_BYTES,
) -> None:
    """Write stored blocks (payloads of ``gather_blocks``' layout, this engine's dtype) into
    blocks ``block_ids`` of every layer's cache: in chunks of at most ``staging_bytes``,
    one copy to the device and one indexed write per layer each."""
    if not payloads:
        return
    first = caches[0]
    per_block = (len(caches), *first.shape[1:])
    host = torch.empty((len(payloads), *per_block), dtype=first.dtype)
    flat = host.view(len(payloads), -1).view(torch.uint8)
    with warnings.catch_warnings():
        # A tensor over a read-only buffer: only read, by the copy.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for i, payload in enumerate(payloads):
            flat[i].copy_(torch.frombuffer(payload, dtype=torch.uint8))
    ids = list(block_ids)
    chunks = _chunks(caches, len(payloads), staging_bytes)
    for start in chunks:
        blocks = host[start : start + chunks.step].to(first.device)
        part = torch.tensor(ids[start : start + len(blocks)], dtype=torch.long, device=first.device)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, part, blocks[:, layer])
