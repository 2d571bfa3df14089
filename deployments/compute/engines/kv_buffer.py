"""KV cache layers that append in place, for the torch engine.

Hugging Face's ``DynamicLayer`` appends by concatenation: every forward pass copies the
layer's whole cache into fresh memory. That is one copy of the entire context per layer
per decode step, and one more of an imported prefix when its suffix is prefilled (34 MB
at 2k tokens of the ``small`` model). :class:`GrowableLayer` keeps the keys and values as
the leading tokens of larger buffers and writes new tokens into the room behind them, so
a step copies only its new tokens. When the room runs out, the buffers grow by a quarter
(at least ``MIN_ROOM_TOKENS``), so the copies cost O(1) per token amortised, and at most
a quarter of a sequence's cache is unused room.

A prefix imported from the store or from L1 arrives in a buffer that already has room for
the prompt's suffix and the first output tokens (:func:`empty_with_room`), so the prefill
writes its suffix there instead of copying the prefix again.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from deployments.compute.engines import kv_arena

MIN_ROOM_TOKENS = 64
# Room that a prefix imported for a request gets for its output tokens, beyond the
# prompt's suffix; more comes by growth.
DECODE_ROOM_TOKENS = 256
_TOKENS_DIM = -2  # of a layer's [batch, heads, tokens, head_dim]
_SPAN_TOKENS_DIM = 3  # of a span's [layers, 2, heads, tokens, head_dim]


def host_empty(shape, dtype: torch.dtype, *, arena: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory comes from plain ``malloc`` (through
    numpy) instead of torch's CPU allocator. Torch asks glibc for 64-byte aligned memory
    (``posix_memalign``), and glibc pads such a request by the alignment: once anything
    small was allocated behind a freed buffer, a new buffer of the same size no longer
    fits in it, so the heap grows and every page of the new buffer faults in fresh (30 MiB
    allocated and freed six times, with a small allocation between: the heap grew 120 MiB
    and four of the six faulted all 7,680 pages; through numpy it grew 0 and none did). A
    buffer from numpy reuses the one freed before it. Replicas run with numpy's huge
    pages off (``NUMPY_MADVISE_HUGEPAGE=0``, app/builder.py MEMORY_ENV): a huge-page
    fault may compact memory first, and decodes into fresh buffers took 30-350 ms.
    ``loadtests/README.md`` ("Page faults in the decode") has the measurements.

    ``arena``: from this process's KV arena when it has one with room (``kv_arena.py``:
    pages touched once, no fault on first write), else as above."""
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = kv_arena.host_bytes(nbytes) if arena else np.empty(nbytes, dtype=np.uint8)
    # A tensor of its own over the array's memory (not a view: room_buffer() recognises
    # a buffer by a span's _base); the storage keeps the array alive (and an arena's
    # array returns its memory when it is freed).
    storage = torch.from_numpy(memory).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _empty(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """An uninitialised KV buffer: on the CPU (the default device) from
    :func:`host_empty` with the process's KV arena, else torch's allocator for that
    device."""
    if device is None or torch.device(device).type == "cpu":
        return host_empty(shape, dtype, arena=True)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def room_for(num_tokens: int) -> int:
    """Room to add when a buffer holding ``num_tokens`` grows."""
    return max(MIN_ROOM_TOKENS, num_tokens // 4)


class GrowableLayer:
    """A cache layer whose ``keys``/``values`` are views of the first ``n`` tokens of
    buffers it owns; ``update`` writes new tokens into the buffers' room.

    Tensors assigned to ``keys``/``values`` from outside (the engine's batch merge and row
    drop, ``crop``, ``batch_select_indices``) are adopted as they are, with no room: this
    layer never writes into memory it did not allocate (or was not handed as its own with
    ``num_tokens`` < the buffer's length), and the next update moves them into new buffers.

    The native model (``llama.py``) calls it as it is; transformers' models get it mixed
    into their ``DynamicLayer`` (:func:`growable_cache` with ``hf=True``), which brings
    the rest of their cache layer's methods.
    """

    def __init__(
        self,
        keys: Optional[torch.Tensor] = None,
        values: Optional[torch.Tensor] = None,
        num_tokens: int = 0,
    ):
        """``keys``/``values``: ``[batch, heads, capacity, head_dim]`` buffers this layer
        may write into, whose first ``num_tokens`` tokens are the cache."""
        super().__init__()
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.is_initialized = False
        self._views: tuple = (None, None)
        if keys is not None:
            if values is None or values.shape != keys.shape or not 0 <= num_tokens <= keys.shape[_TOKENS_DIM]:
                raise ValueError("keys and values need one shape with room for num_tokens")
            self._own(keys, values, num_tokens)

    def _own(self, kbuf: torch.Tensor, vbuf: torch.Tensor, num_tokens: int) -> None:
        self._kbuf, self._vbuf, self._n = kbuf, vbuf, num_tokens
        self.keys = kbuf.narrow(_TOKENS_DIM, 0, num_tokens)
        self.values = vbuf.narrow(_TOKENS_DIM, 0, num_tokens)
        self._views = (self.keys, self.values)
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.is_initialized = True

    @property
    def num_tokens(self) -> int:
        """Tokens in the cache (of every row: the batch is left-padded)."""
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[_TOKENS_DIM]

    def get_seq_length(self) -> int:
        return self.num_tokens

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before the next growth (0 when not initialised)."""
        if not self.is_initialized or self._views[0] is not self.keys:
            return 0 if self.keys is None else self.keys.shape[_TOKENS_DIM]
        return self._kbuf.shape[_TOKENS_DIM]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[_TOKENS_DIM]
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            shape = list(key_states.shape)
            shape[_TOKENS_DIM] = new + room_for(new)
            self._own(
                _empty(shape, key_states.dtype, key_states.device),
                _empty(shape, value_states.dtype, value_states.device),
                0,
            )
        elif self.keys is not self._views[0] or self.values is not self._views[1]:
            # Assigned from outside: adopted with no room (never written into).
            self._own(self.keys, self.values, self.keys.shape[_TOKENS_DIM])
        n = self._n
        if n + new > self._kbuf.shape[_TOKENS_DIM]:
            shape = list(self._kbuf.shape)
            shape[_TOKENS_DIM] = n + new + room_for(n + new)
            kbuf = _empty(shape, self._kbuf.dtype, self._kbuf.device)
            vbuf = _empty(shape, self._vbuf.dtype, self._vbuf.device)
            kbuf.narrow(_TOKENS_DIM, 0, n).copy_(self.keys)
            vbuf.narrow(_TOKENS_DIM, 0, n).copy_(self.values)
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf.narrow(_TOKENS_DIM, n, new).copy_(key_states)
        self._vbuf.narrow(_TOKENS_DIM, n, new).copy_(value_states)
        self._own(self._kbuf, self._vbuf, n + new)
        return self.keys, self.values

    def reset(self) -> None:
        if hasattr(super(), "reset"):
            super().reset()
        else:
            self.keys = self.values = None
            self.is_initialized = False
        self._views = (None, None)


class LayerCache:
    """The native model's cache: its layers, nothing else (``llama.py``)."""

    def __init__(self, layers: list[GrowableLayer]):
        self.layers = layers


_hf_layer_class = None


def _hf_growable_layer() -> type:
    """:class:`GrowableLayer` over transformers' ``DynamicLayer`` (made on first use, so
    that a native model's process never imports transformers)."""
    global _hf_layer_class
    if _hf_layer_class is None:
        from transformers.cache_utils import DynamicLayer

        _hf_layer_class = type("HFGrowableLayer", (GrowableLayer, DynamicLayer), {})
    return _hf_layer_class


def growable_cache(num_layers: int, span: Optional[torch.Tensor] = None, *, hf: bool = False):
    """A cache of :class:`GrowableLayer` (a transformers ``DynamicCache`` with ``hf``, for
    transformers' models; else a :class:`LayerCache`); with ``span``
    (``[layers, 2, heads, P, head_dim]``, batch of one), pre-filled with its P tokens,
    writing behind them into the room of the buffer ``span`` leads, if it is one made by
    :func:`empty_with_room` (else the first update copies it into a new buffer)."""
    layer_class = _hf_growable_layer() if hf else GrowableLayer
    if span is None:
        layers = [layer_class() for _ in range(num_layers)]
    else:
        if span.shape[0] != num_layers:
            raise ValueError(f"a span of {span.shape[0]} layers for a model of {num_layers}")
        buf, num_tokens = room_buffer(span), span.shape[_SPAN_TOKENS_DIM]
        layers = [
            layer_class(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0), num_tokens) for i in range(num_layers)
        ]
    if not hf:
        return LayerCache(layers)
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layers = layers
    return cache


def empty_with_room(shape, room: int, *, dtype: torch.dtype, device=None) -> torch.Tensor:
    """An uninitialised span of ``shape`` (``[layers, 2, heads, P, head_dim]``) that is
    the leading part of a buffer with ``room`` more tokens (see :func:`room_buffer`)."""
    full = list(shape)
    full[_SPAN_TOKENS_DIM] += max(0, int(room))
    return _empty(full, dtype, device).narrow(_SPAN_TOKENS_DIM, 0, shape[_SPAN_TOKENS_DIM])


def room_buffer(span: torch.Tensor) -> torch.Tensor:
    """The buffer that ``span`` leads, with its room, if :func:`empty_with_room` made it
    (a view starting at the buffer's first element, same layout, same sizes but tokens);
    else ``span`` itself. Any other view of a larger tensor counts as having no room, so
    nothing is ever written into memory that belongs to someone else."""
    base = span._base
    if (
        base is None
        or base.dim() != 5
        or not base.is_contiguous()
        or span.data_ptr() != base.data_ptr()
        or span.stride() != base.stride()
        or span.shape[:_SPAN_TOKENS_DIM] != base.shape[:_SPAN_TOKENS_DIM]
        or span.shape[_SPAN_TOKENS_DIM + 1 :] != base.shape[_SPAN_TOKENS_DIM + 1 :]
    ):
        return span
    return base


def with_room(span: torch.Tensor, room: int, device: torch.device) -> torch.Tensor:
    """``span`` on ``device`` with at least ``room`` tokens of room behind it: as it is when
    it has them there already, else copied once into a new buffer (what moving it to the
    device costs anyway)."""
    buf = room_buffer(span)
    have = buf.shape[_SPAN_TOKENS_DIM] - span.shape[_SPAN_TOKENS_DIM]
    if span.device == device and have >= room:
        return span
    out = empty_with_room(span.shape, room, dtype=span.dtype, device=device)
    out.copy_(span)
    return out
