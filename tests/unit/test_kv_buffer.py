"""kv_buffer: cache layers that append in place (exact contents, in-place writes, growth,
never writing into memory they were not given) and a model's forward on them."""

from __future__ import annotations

import pytest
import torch

from deployments.compute.engines import kv_buffer
from deployments.compute.engines.kv_buffer import (
    GrowableLayer,
    empty_with_room,
    host_empty,
    growable_cache,
    room_buffer,
    with_room,
)
from deployments.compute.engines.kv_codec import decode_kv_blocks, encode_kv_blocks
from deployments.compute.engines.prefix_cache import PrefixCache

B, H, D = 2, 3, 4


@pytest.fixture(autouse=True, params=["malloc", "arena"])
def buffer_memory(request):
    """Every test twice: buffers from malloc, and from a KV arena (kv_arena.py), as in a
    worker once its arena is populated."""
    from deployments.compute.engines import kv_arena

    kv_arena.uninstall()
    if request.param == "arena":
        kv_arena.install(16 << 20, background=False)
    yield request.param
    kv_arena.uninstall()


@pytest.fixture(params=["native", "transformers"])
def layer_class(request):
    """The layer as the native model gets it, and mixed into transformers' DynamicLayer."""
    return GrowableLayer if request.param == "native" else kv_buffer._hf_growable_layer()


def _states(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def test_updates_equal_concatenation_and_write_in_place_until_the_room_is_gone(layer_class):
    layer = layer_class()
    ref_k = torch.empty(B, H, 0, D)
    ref_v = torch.empty(B, H, 0, D)
    grew = 0
    ptr = None
    for step, t in enumerate([5, 1, 1, 30, 1, 60, 1, 1, 200, 1]):
        k, v = _states(t, step)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        capacity_before = layer.capacity
        keys, values = layer.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert layer.get_seq_length() == ref_k.shape[2]
        if ptr is not None and ref_k.shape[2] <= capacity_before:
            assert keys.data_ptr() == ptr, f"step {step} copied the cache though it had room"
        elif ptr is not None:
            grew += 1
            assert layer.capacity >= ref_k.shape[2] + kv_buffer.MIN_ROOM_TOKENS
        ptr = keys.data_ptr()
    assert grew >= 2  # the sizes above outgrow the room more than once


def test_tensors_assigned_from_outside_are_never_written_into(layer_class):
    layer = layer_class()
    layer.update(*_states(8, 0))
    # What the engine's batch merge/row drop do: assign views of other memory.
    backing_k = torch.full((B, H, 20, D), 7.0)
    backing_v = torch.full((B, H, 20, D), 9.0)
    layer.keys, layer.values = backing_k[:, :, 2:10], backing_v[:, :, 2:10]
    before_k, before_v = backing_k.clone(), backing_v.clone()
    k, v = _states(3, 1)
    keys, values = layer.update(k, v)
    assert torch.equal(backing_k, before_k) and torch.equal(backing_v, before_v)
    assert torch.equal(keys, torch.cat([before_k[:, :, 2:10], k], dim=2))
    assert torch.equal(values, torch.cat([before_v[:, :, 2:10], v], dim=2))
    # From then on it appends into its own new buffer.
    ptr = keys.data_ptr()
    assert layer.update(*_states(1, 2))[0].data_ptr() == ptr


def test_batch_select_and_crop_keep_working():
    """transformers' cache operations (its DynamicLayer's) on the mixed-in layer."""
    layer = kv_buffer._hf_growable_layer()()
    k, v = _states(10, 0)
    layer.update(k, v)
    layer.batch_select_indices(torch.tensor([1]))
    layer.crop(-2)
    k2, v2 = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    keys, values = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([k[1:, :, :8], k2], dim=2))
    assert torch.equal(values, torch.cat([v[1:, :, :8], v2], dim=2))


def test_a_span_with_room_takes_the_suffix_in_place_and_one_without_is_left_alone():
    L, P = 2, 6
    span = empty_with_room((L, 2, H, P, D), 10, dtype=torch.float32)
    span.copy_(torch.randn(L, 2, H, P, D))
    prefix = span.clone()
    buf = room_buffer(span)
    assert buf.shape[3] == P + 10 and buf.data_ptr() == span.data_ptr()
    cache = growable_cache(L, span)
    for i, layer in enumerate(cache.layers):
        k, v = torch.randn(1, H, 3, D), torch.randn(1, H, 3, D)
        keys, values = layer.update(k, v)
        assert torch.equal(keys[0], torch.cat([prefix[i, 0], k[0]], dim=1))
        assert torch.equal(values[0], torch.cat([prefix[i, 1], v[0]], dim=1))
        assert keys.data_ptr() == span[i, 0].data_ptr()  # written into the span's buffer
        assert torch.equal(buf[i, 0, :, P : P + 3], k[0])

    # A span that leads no buffer of ours (here: a slice of someone's tensor) is only read.
    owner = torch.randn(L, 2, H, P + 10, D)
    before = owner.clone()
    plain = owner[:, :, :, 2 : 2 + P]
    assert room_buffer(plain) is plain
    cache = growable_cache(L, plain)
    for layer in cache.layers:
        layer.update(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D))
    assert torch.equal(owner, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_buffers_are_plain_tensors_and_lead_their_room(dtype):
    t = host_empty([2, 2, 3, 5, 4], dtype)
    assert t.shape == (2, 2, 3, 5, 4) and t.dtype == dtype and t.is_contiguous() and t._base is None
    t.fill_(2)
    assert float(t.float().sum()) == 2 * t.numel()
    span = empty_with_room([2, 2, 3, 5, 4], 7, dtype=dtype)
    assert room_buffer(span).shape == (2, 2, 3, 12, 4) and room_buffer(span).dtype == dtype
    assert host_empty([0, 4], dtype).shape == (0, 4)


_REUSE = """
import ctypes, resource, sys, torch
from deployments.compute.engines.kv_buffer import empty_with_room
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    span = empty_with_room([4, 2, 8, 1800, 64], 200, dtype=torch.float32)  # a 31 MiB prefix buffer
    span.fill_(1.0)
    libc.malloc(100)  # something small allocated behind it, as always happens in a worker
    del span
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def test_a_freed_prefix_buffer_serves_the_next_one_without_fresh_pages():
    """With a replica's malloc settings (app/builder.py MEMORY_ENV), a buffer of the same
    size as one just freed reuses its pages: none of them faults again. (Through torch's
    own allocator, 64-byte aligned, the heap grew by each buffer and most faulted every
    page, 7,680 of 30 MiB.)"""
    import json
    import os
    import subprocess
    import sys

    from app.builder import MEMORY_ENV

    out = subprocess.run(
        [sys.executable, "-c", _REUSE], env={**os.environ, **MEMORY_ENV}, capture_output=True, text=True,
        timeout=120, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    ).stdout
    faults = json.loads(out.strip().splitlines()[-1])
    pages = 4 * 2 * 8 * 2000 * 64 * 4 // 4096
    assert faults[0] > 0  # the first one is fresh memory (huge pages make it far fewer than pages)
    assert all(f < pages // 20 for f in faults[1:]), (faults, pages)


def test_room_buffer_refuses_views_that_do_not_lead_a_plain_buffer():
    base = torch.zeros(2, 2, H, 10, D)
    assert room_buffer(base.narrow(3, 0, 6)) is base
    assert room_buffer(base.narrow(3, 1, 6)).shape[3] == 6  # not at the start
    assert room_buffer(base[:1].narrow(3, 0, 6)).shape[3] == 6  # fewer layers than the buffer
    transposed = base.transpose(2, 4).narrow(3, 0, 6)  # another layout
    assert room_buffer(transposed) is transposed


def test_with_room_copies_only_when_the_room_is_missing():
    span = empty_with_room((1, 2, H, 4, D), 8, dtype=torch.float32)
    assert with_room(span, 8, torch.device("cpu")) is span
    bigger = with_room(span, 9, torch.device("cpu"))
    assert bigger is not span and room_buffer(bigger).shape[3] == 4 + 9
    plain = torch.randn(1, 2, H, 4, D)
    moved = with_room(plain, 5, torch.device("cpu"))
    assert torch.equal(moved, plain) and room_buffer(moved).shape[3] == 9


def test_decode_and_l1_hand_out_spans_with_room():
    shape = (2, 2, H, 4, D)
    src = torch.randn(2, 2, H, 12, D)
    blocks = encode_kv_blocks(src, 4)
    out = empty_with_room((2, 2, H, 12, D), 20, dtype=torch.float32)
    span = decode_kv_blocks(blocks, dtype=torch.float32, shape=shape, out=out)
    assert span is out and torch.equal(span, src) and room_buffer(span).shape[3] == 32
    with pytest.raises(ValueError):
        decode_kv_blocks(blocks, dtype=torch.float32, shape=shape, out=torch.empty(2, 2, H, 8, D))

    l1 = PrefixCache(1 << 20, 4)
    l1.put(["a", "b", "c"], src)
    got = l1.get(["a", "b"], room=7)
    assert torch.equal(got, src[:, :, :, :8]) and room_buffer(got).shape[3] == 15


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_model_forward_on_growable_layers_matches_dynamic_cache(tiny_model_path, monkeypatch, impl):
    """A prefill then decode steps (outgrowing the room several times) give the logits of
    transformers' model on its own DynamicCache, and so does a prefill onto an imported
    prefix: with transformers' model on the mixed-in layers, and with the native model."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from deployments.compute.engines.llama import LlamaForCausalLM

    monkeypatch.setattr(kv_buffer, "MIN_ROOM_TOKENS", 2)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    model = hf_model if impl == "transformers" else LlamaForCausalLM.from_pretrained(tiny_model_path)
    hf = impl == "transformers"
    num_layers = hf_model.config.num_hidden_layers
    ids = torch.randint(10, 200, (1, 40), generator=torch.Generator().manual_seed(0))

    def run(cache, start: int, model=model):
        logits = []
        with torch.inference_mode():
            out = model(
                input_ids=ids[:, start:30],
                position_ids=torch.arange(start, 30).unsqueeze(0),
                attention_mask=torch.ones(1, 30, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
            for n in range(30, 40):
                out = model(
                    input_ids=ids[:, n : n + 1],
                    position_ids=torch.tensor([[n]]),
                    attention_mask=torch.ones(1, n + 1, dtype=torch.long),
                    past_key_values=cache,
                    use_cache=True,
                )
                logits.append(out.logits[:, -1])
        return torch.cat(logits)

    reference = run(DynamicCache(), 0, hf_model)
    torch.testing.assert_close(run(growable_cache(num_layers, hf=hf), 0), reference, rtol=0, atol=1e-5)

    # The first 16 tokens' K/V, imported into a span with room: only ids[16:] are fed.
    prefix_cache = DynamicCache()
    with torch.inference_mode():
        hf_model(input_ids=ids[:, :16], past_key_values=prefix_cache, use_cache=True)
    span = empty_with_room((num_layers, 2) + tuple(prefix_cache.layers[0].keys.shape[1:]), 20, dtype=torch.float32)
    for i, layer in enumerate(prefix_cache.layers):
        span[i, 0].copy_(layer.keys[0])
        span[i, 1].copy_(layer.values[0])
    torch.testing.assert_close(run(growable_cache(num_layers, span, hf=hf), 16), reference, rtol=0, atol=1e-5)
