"""L1: the KV blocks of recent prompts in a worker's own memory, by chained block hash.

The torch engine keeps no KV between requests in its running batch, so without this every
reused prefix would come from the data plane (L2 host memory of the DataPlane actors, or
Redis), one Serve hop and a decode away. This cache keeps a copy of the blocks a request
exported (and of the blocks it fetched) in the worker process, so a later request on the
*same* replica (the next turn of a session, another request with the same system prompt)
reads them without leaving the process. That is what cache-aware placement
(``deployments/router/placement.py``) steers requests to: the worker reports the keys of
the blocks held here (:meth:`PrefixCache.packed_keys`) through ``record_routing_stats``.

Blocks are ``[layers, 2, kv_heads, block_size, head_dim]`` CPU tensors, evicted least
recently used by bytes. A block is usable only with every block before it (the hashes are
chained), so lookups count leading blocks. Thread-safe: the engine inserts from worker
threads (encoding, decoding) and looks up on its event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from deployments.compute.engines.kv_buffer import empty_with_room

# Bytes of a hash in the reported keys: see deployments/router/placement.py:block_key.
REPORTED_KEY_BYTES = 8


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_size: int, max_reported_keys: int = 4096):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.max_reported_keys = max_reported_keys
        self._lock = threading.Lock()
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._version = 0
        self._packed: tuple[int, bytes] = (-1, b"")
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def longest_prefix(self, hashes: Sequence[str]) -> int:
        """Leading blocks of ``hashes`` held here (marks them recently used)."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._blocks:
                    break
                self._blocks.move_to_end(h)
                n += 1
        return n

    def get(self, hashes: Sequence[str], room: int = 0) -> torch.Tensor | None:
        """The K/V of these leading blocks as one ``[layers, 2, kv_heads, P, head_dim]``
        tensor (a new one: the cache's blocks are never handed out), or None if one is
        missing (evicted since the lookup). ``room``: tokens of room behind it, for the
        engine's cache to append into (``kv_buffer.empty_with_room``)."""
        with self._lock:
            blocks = [self._blocks.get(h) for h in hashes]
        if not blocks or any(b is None for b in blocks):
            return None
        shape = list(blocks[0].shape)
        shape[3] = sum(b.shape[3] for b in blocks)
        out = empty_with_room(shape, room, dtype=blocks[0].dtype, device=blocks[0].device)
        return torch.cat(blocks, dim=3, out=out)  # in place, also into a view with room

    def put(self, hashes: Sequence[str], span: torch.Tensor) -> None:
        """Keep the blocks of ``span`` (``[layers, 2, kv_heads, len(hashes) × block_size,
        head_dim]``, any device) under their hashes."""
        bs = self.block_size
        if span.shape[3] != len(hashes) * bs:
            raise ValueError(f"{len(hashes)} hashes for a span of {span.shape[3]} tokens")
        copies = []
        for i, h in enumerate(hashes):
            with self._lock:
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
            block = span[:, :, :, i * bs : (i + 1) * bs, :].to("cpu", copy=True).contiguous()
            copies.append((h, block))
        with self._lock:
            for h, block in copies:
                if h in self._blocks:
                    continue
                self._blocks[h] = block
                self._bytes += block.numel() * block.element_size()
            while self._bytes > self.capacity_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
                self.evictions += 1
            self._version += 1

    def discard(self, hashes: Iterable[str]) -> int:
        """Drop these blocks, those held here; how many were. A deleted session's blocks
        leave this way (``DataPlane.delete_session`` → ``ComputeWorker.drop_kv_blocks``)."""
        n = 0
        with self._lock:
            for h in hashes:
                block = self._blocks.pop(h, None)
                if block is not None:
                    self._bytes -= block.numel() * block.element_size()
                    n += 1
            if n:
                self._version += 1  # the keys reported for placement change
        return n

    def packed_keys(self) -> bytes:
        """The most recently used ``max_reported_keys`` hashes, first 8 bytes each,
        concatenated (rebuilt only when the cache changed)."""
        with self._lock:
            if self._packed[0] == self._version:
                return self._packed[1]
            recent = list(self._blocks)[-self.max_reported_keys :]
            blob = b"".join(bytes.fromhex(h[: 2 * REPORTED_KEY_BYTES]) for h in recent)
            self._packed = (self._version, blob)
            return blob

