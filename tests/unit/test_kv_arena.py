"""kv_arena: the torch engine's KV buffers from host memory touched once (exact free-list
state, best fit, coalescing, returns from other threads, fallback to malloc, no overlap
of live buffers, and the engine's buffers landing in it)."""

from __future__ import annotations

import gc
import random
import threading

import numpy as np
import pytest
import torch

from deployments.compute.engines import kv_arena, kv_buffer
from deployments.compute.engines.kv_arena import ALIGN, HostArena

PAGE = ALIGN


@pytest.fixture
def installed():
    """This process's arena for one test (the module's global), dropped after it."""
    kv_arena.uninstall()
    kv_arena.install(8 << 20, background=False)
    yield kv_arena.current()
    kv_arena.uninstall()


def test_takes_best_fit_and_coalesces_what_returns():
    arena = HostArena(16 * PAGE)
    a = arena.take(5000)  # two pages
    b = arena.take(PAGE)
    c = arena.take(3 * PAGE)
    assert (len(a), len(b), len(c)) == (5000, PAGE, 3 * PAGE)
    assert arena.free_ranges() == [(6 * PAGE, 10 * PAGE)]
    assert arena.stats()["used_bytes"] == 6 * PAGE
    del a, c
    assert arena.free_ranges() == [(0, 2 * PAGE), (3 * PAGE, 13 * PAGE)]
    # Best fit: one page goes into the two-page hole, not the large range behind.
    d = arena.take(PAGE)
    assert arena.free_ranges() == [(PAGE, PAGE), (3 * PAGE, 13 * PAGE)]
    del b  # touches the hole before it and the range behind it: one range again with d's
    assert arena.free_ranges() == [(PAGE, 15 * PAGE)]
    del d
    assert arena.free_ranges() == [(0, 16 * PAGE)]
    assert arena.stats() == {
        "capacity_bytes": 16 * PAGE, "used_bytes": 0, "free_ranges": 1, "taken": 4, "fallbacks": 0,
    }


def test_no_room_is_a_fallback_not_an_error():
    arena = HostArena(4 * PAGE)
    keep = arena.take(3 * PAGE)
    assert arena.take(2 * PAGE) is None
    assert arena.stats()["fallbacks"] == 1
    assert arena.take(PAGE) is not None
    del keep
    with pytest.raises(ValueError):
        arena.take(0)
    with pytest.raises(ValueError):
        HostArena(0)


def test_live_buffers_never_overlap_and_keep_their_bytes():
    """Random takes and frees: each live buffer keeps the bytes written into it until it is
    freed (nothing else was carved out of its memory), and all of it returns at the end."""
    arena = HostArena(64 * PAGE)
    rng = random.Random(7)
    live: list[tuple[np.ndarray, int]] = []
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 12):
            buf, value = live.pop(rng.randrange(len(live)))
            assert (buf == value).all(), f"step {step}: a live buffer was overwritten"
            del buf
            continue
        buf = arena.take(rng.randint(1, 9 * PAGE))
        if buf is None:
            continue
        value = step % 251
        buf[:] = value
        live.append((buf, value))
    assert all((kept == value).all() for kept, value in live)
    live.clear()
    buf = None  # the loop's last buffer
    gc.collect()
    assert arena.free_ranges() == [(0, 64 * PAGE)]
    assert arena.stats()["used_bytes"] == 0


def test_memory_returns_only_when_the_last_tensor_over_it_is_freed(installed):
    lo, hi = installed.address_range()
    t = kv_buffer._empty((2, 3, 40, 64), torch.float32)
    assert lo <= t.data_ptr() < hi
    used = installed.stats()["used_bytes"]
    assert used >= t.numel() * 4
    view = t[:, :, 5:]
    del t
    assert installed.stats()["used_bytes"] == used  # the view still holds it
    del view
    assert installed.stats()["used_bytes"] == 0
    # And numpy views of a buffer, which name their base themselves.
    buf = kv_arena.host_bytes(3 * PAGE)
    assert lo <= buf.ctypes.data < hi
    part = buf[PAGE:][::2]
    del buf
    assert installed.stats()["used_bytes"] == 3 * PAGE
    part[:] = 7
    del part
    assert installed.stats()["used_bytes"] == 0
    assert not lo <= kv_arena.host_bytes(16 << 20).ctypes.data < hi  # no room: malloc


def test_a_buffer_freed_on_another_thread_returns(installed):
    t = kv_buffer._empty((1, 2, 100, 64), torch.float32)
    holder = [t]
    del t
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    assert installed.stats()["used_bytes"] == 0
    assert installed.free_ranges() == [(0, installed.capacity)]


def test_buffers_beyond_the_arena_come_from_malloc(installed):
    lo, hi = installed.address_range()
    big = kv_buffer._empty((1, 2, 20_000, 64), torch.float32)  # ~10 MiB > 8 MiB
    assert not lo <= big.data_ptr() < hi
    assert installed.stats()["fallbacks"] == 1
    big.fill_(1.0)
    assert float(big.sum()) == big.numel()


def test_a_cache_appends_in_place_in_arena_memory(installed):
    """The engine's path: a prefix decoded into a span with room (empty_with_room), then a
    cache over it whose suffix lands behind the prefix, in the same arena buffer."""
    lo, hi = installed.address_range()
    L, H, P, D = 2, 3, 10, 8
    span = kv_buffer.empty_with_room((L, 2, H, P, D), 6, dtype=torch.float32)
    assert lo <= span.data_ptr() < hi
    span.copy_(torch.randn(L, 2, H, P, D))
    cache = kv_buffer.growable_cache(L, span)
    k, v = torch.randn(1, H, 4, D), torch.randn(1, H, 4, D)
    keys, values = cache.layers[0].update(k, v)
    assert keys.data_ptr() == span[0, 0].data_ptr()  # no copy: written into the room
    assert torch.equal(keys[0, :, :P], span[0, 0]) and torch.equal(keys[0, :, P:], k[0])
    assert torch.equal(values[0, :, P:], v[0])
    # A layer that outgrows its room moves into a new arena buffer.
    more = torch.randn(1, H, 10, D)
    keys, _ = cache.layers[0].update(more, more)
    assert lo <= keys.data_ptr() < hi and keys.shape[2] == P + 14
    assert torch.equal(keys[0, :, P + 4 :], more[0])


def test_install_keeps_a_larger_arena_and_zero_is_none():
    kv_arena.uninstall()
    try:
        kv_arena.install(0, background=False)
        assert kv_arena.current() is None
        kv_arena.install(4 << 20, background=False)
        first = kv_arena.current()
        kv_arena.install(2 << 20, background=False)
        assert kv_arena.current() is first
        kv_arena.install(6 << 20, background=False)
        assert kv_arena.current().capacity == 6 << 20
    finally:
        kv_arena.uninstall()


def test_the_engine_caps_its_arena_at_what_its_sequences_can_hold(tiny_model_path):
    from deployments.compute.engines.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model_path, max_num_seqs=2, max_model_len=256, kv_arena_bytes=256 << 20)
    per_token = engine._kv_token_bytes()
    assert per_token == engine.config.num_hidden_layers * 2 * engine.config.num_key_value_heads * 64 * 4
    assert engine.kv_arena_bytes == 2 * (256 * 5 // 4) * per_token
    assert TorchEngine(tiny_model_path, max_num_seqs=64, kv_arena_bytes=1 << 20).kv_arena_bytes == 1 << 20
    assert TorchEngine(tiny_model_path, kv_arena_bytes=0).kv_arena_bytes == 0
    with pytest.raises(ValueError, match="kv_arena_bytes"):
        TorchEngine(tiny_model_path, kv_arena_bytes=-1)


_GROWING = """
import ctypes, json, resource, sys, torch
from deployments.compute.engines import kv_arena
from deployments.compute.engines.kv_buffer import empty_with_room
if sys.argv[1] == "arena":
    kv_arena.install(96 << 20, background=False)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
empty_with_room([1, 2, 1, 4, 4], 4, dtype=torch.float32).fill_(0.0)  # torch's first-use costs
faults = []
for tokens in range(1200, 2100, 100):  # a conversation's prefix, turn by turn
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    span = empty_with_room([4, 2, 8, tokens, 64], 200, dtype=torch.float32)  # up to 31 MiB
    span.fill_(1.0)
    libc.malloc(100)  # something small allocated behind it, as always happens in a worker
    del span
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def test_growing_prefix_buffers_fault_no_page_in_the_arena():
    """What the arena is for: a session's prefix buffer outgrows the one before it every
    turn, so from malloc (a replica's settings, app/builder.py MEMORY_ENV) each turn's
    growth faults in fresh pages; from the arena none does, the first turn included."""
    import json
    import os
    import subprocess
    import sys

    from app.builder import MEMORY_ENV

    def run(memory: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", _GROWING, memory], env={**os.environ, **MEMORY_ENV}, capture_output=True,
            text=True, timeout=120, check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        ).stdout
        return json.loads(out.strip().splitlines()[-1])

    growth_pages = 4 * 2 * 8 * 100 * 64 * 4 // 4096  # 100 tokens more a turn: 400 pages
    malloc, arena = run("malloc"), run("arena")
    assert sum(malloc[1:]) >= len(malloc[1:]) * growth_pages // 2, malloc  # the control
    assert all(f < growth_pages // 10 for f in arena), (arena, malloc)
