"""KV export/import in the torch engine, on the tiny checkpoint with an in-memory store:
an imported prefix gives the same logits and tokens as a full recompute, a second turn
prefills only its new suffix, store failures are misses, and hits mix with misses in one
running batch."""

import asyncio
import logging
import re
import threading

import pytest
import pytest_asyncio
import torch

from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.kv_codec import decode_kv_blocks
from deployments.compute.engines.protocol import EngineDeadError, GenerationRequest, SamplingParams
from deployments.compute.engines.torch_engine import TorchEngine
from tests.fixtures.kv import DictKVConnector
from tests.fixtures.logs import messages_containing, serve_log_captured

BLOCK = 8
PROMPTS = [
    "A much longer prompt: " + "the model reads many words before it answers " * 6,
    "Server memory cluster worker router latency is important to the people of the city",
    "hello world and the cache went to the river and the river went to the sea again",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "café 🙂 naïve",
    "the",
]


def make_request(request_id, prompt_ids, tenant="default", **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 12)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(request_id, list(prompt_ids), SamplingParams(**sampling), tenant=tenant)


async def collect(engine, request):
    return [t async for d in engine.generate(request) for t in d.token_ids]


class LogitsRecorder:
    """Keeps the logits of each request's first generated position (its prefill)."""

    def __init__(self):
        self.first: dict[str, torch.Tensor] = {}

    def __call__(self, request_ids, logits, phase):
        if phase == "prefill":
            for rid, row in zip(request_ids, logits):
                self.first[rid] = row


@pytest_asyncio.fixture
async def store():
    return DictKVConnector(block_size=BLOCK)


@pytest_asyncio.fixture
async def engine(tiny_model_path, store):
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=4, num_threads=2, kv_connector=store,
                      model_id="tiny", block_size=BLOCK)
    eng.logits_hook = LogitsRecorder()
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest_asyncio.fixture
async def plain(tiny_model_path):
    """The reference: the same engine without a connector."""
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=4, num_threads=2)
    eng.logits_hook = LogitsRecorder()
    await eng.start()
    yield eng
    await eng.shutdown()


def encode(engine, text):
    return engine.tokenizer(text)["input_ids"]


async def run_and_export(engine, request):
    tokens = await collect(engine, request)
    await engine.wait_for_kv_exports()
    return tokens


def test_capabilities_and_block_size_check(tiny_model_path):
    assert TorchEngine.capabilities.supports_kv_export
    with pytest.raises(ValueError, match="block_size"):
        TorchEngine(str(tiny_model_path), kv_connector=DictKVConnector(block_size=16), block_size=8)


@pytest.mark.asyncio
async def test_imported_prefix_matches_full_recompute(engine, plain, store):
    ids = encode(engine, PROMPTS[0])
    assert len(ids) > 4 * BLOCK
    first = await run_and_export(engine, make_request("first", ids))
    stats = engine.kv_stats()
    assert stats.prefix_hit_tokens == 0 and stats.prefilled_tokens == len(ids)
    # Processed tokens = prompt + all outputs but the last (never fed): their full blocks.
    expected_blocks = (len(ids) + len(first) - 1) // BLOCK
    assert stats.blocks_exported == expected_blocks == len(store.blocks)

    again = await collect(engine, make_request("again", ids))
    stats = engine.kv_stats()
    hit_tokens = (len(ids) - 1) // BLOCK * BLOCK  # the last prompt token is always prefilled
    assert stats.prefix_hit_tokens == hit_tokens and stats.blocks_imported == hit_tokens // BLOCK
    assert stats.prefilled_tokens == len(ids) + (len(ids) - hit_tokens)
    assert stats.fetch_failures == 0
    assert store.fetches and store.fetches[-1][1] > 0  # the engine fed the bandwidth estimate

    reference = await collect(plain, make_request("ref", ids))
    assert again == first == reference
    imported = engine.logits_hook.first["again"]
    recomputed = plain.logits_hook.first["ref"]
    assert imported.shape == recomputed.shape
    torch.testing.assert_close(imported, recomputed, atol=1e-4, rtol=0)
    torch.testing.assert_close(engine.logits_hook.first["first"], recomputed, atol=1e-4, rtol=0)
    # The tolerance is meaningful: another prompt's logits are far outside it.
    other = await collect(plain, make_request("other", encode(engine, PROMPTS[1])))
    assert other and (plain.logits_hook.first["other"] - recomputed).abs().max() > 1e-2


@pytest.mark.asyncio
async def test_stored_blocks_are_the_models_kv(engine, store, tiny_model_path):
    """The exported blocks hold exactly the K/V a plain forward computes, so a cache built
    from them reproduces the full-prompt logits when fed only the rest of the prompt."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = encode(engine, PROMPTS[1])
    await run_and_export(engine, make_request("x", ids, max_tokens=2))
    hashes = block_hashes("tiny", "default", ids, BLOCK)
    span = decode_kv_blocks([store.blocks[("default", h)] for h in hashes],
                            dtype=torch.float32, shape=engine._kv_block_shape)
    num_prefix = span.shape[3]
    with torch.inference_mode():
        full = model(torch.tensor([ids]), use_cache=True)
        for layer, stored in zip(full.past_key_values.layers, span):
            torch.testing.assert_close(layer.keys[0, :, :num_prefix], stored[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[0, :, :num_prefix], stored[1], atol=1e-5, rtol=0)
        cache = DynamicCache(ddp_cache_data=[(s[0][None], s[1][None]) for s in span])
        rest = model(torch.tensor([ids[num_prefix:]]), past_key_values=cache,
                     position_ids=torch.arange(num_prefix, len(ids))[None],
                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    torch.testing.assert_close(rest.logits[0, -1], full.logits[0, -1], atol=1e-4, rtol=0)


@pytest.mark.asyncio
async def test_second_turn_prefills_only_the_new_suffix(engine, plain):
    turn1 = encode(engine, PROMPTS[1])
    out1 = await run_and_export(engine, make_request("t1", turn1, max_tokens=10))
    assert out1 == await collect(plain, make_request("r1", turn1, max_tokens=10))
    # The conversation continues: turn 1's prompt and answer, then a new user message.
    turn2 = turn1 + out1 + encode(engine, " and then what happened to the worker")[1:]
    before = engine.kv_stats()
    request2 = make_request("t2", turn2, max_tokens=10)
    request2.session_id = "sess_" + "e" * 32
    out2 = await run_and_export(engine, request2)
    after = engine.kv_stats()
    # Everything turn 1 cached (its prompt and all but its last output token) is reused.
    hit = (len(turn1) + len(out1) - 1) // BLOCK * BLOCK
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == hit
    assert after.prefilled_tokens - before.prefilled_tokens == len(turn2) - hit
    assert len(turn2) - hit < len(turn2) - len(turn1)  # less than even the new part plus the answer
    assert out2 == await collect(plain, make_request("r2", turn2, max_tokens=10))
    # Turn 2 exported only its new blocks, chained onto turn 1's.
    all_hashes = block_hashes("tiny", "default", turn2 + out2[:-1], BLOCK)
    assert engine._kv.saves[-1][1] == all_hashes[hit // BLOCK :]
    # ...and named the chain's first block, so a sharded store keeps the continuation on
    # the shard where lookups of the whole chain go.
    assert engine._kv.chain_roots[-1] == all_hashes[0] != all_hashes[hit // BLOCK]
    # ...and its session, which lists them so that deleting the session erases them.
    assert engine._kv.session_ids[-2:] == [None, "sess_" + "e" * 32]


@pytest.mark.asyncio
async def test_an_import_logs_its_parts_and_its_decode_faults_at_debug(engine, caplog):
    """The line that splits a fetched prefix's time (lookup, load, decode) and counts the
    page faults of its decode, whose fresh buffer pages are most of a slow decode here."""
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("log-prime", ids))
    with serve_log_captured(caplog, logging.DEBUG):  # the engine's logger
        await collect(engine, make_request("log-import", ids))
    lines = messages_containing(caplog, "kv prefix fetched")
    assert len(lines) == 1, lines
    assert re.search(
        r"request=log-import tier=\S+ blocks=\d+ bytes=\d+ lookup_ms=[\d.]+ load_ms=[\d.]+ "
        r"decode_ms=[\d.]+ decode_faults=\d+$",
        lines[0],
    ), lines[0]


@pytest.mark.asyncio
async def test_tenants_do_not_share_blocks(engine):
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("a", ids, tenant="alice"))
    await collect(engine, make_request("b", ids, tenant="bob"))
    assert engine.kv_stats().prefix_hit_tokens == 0
    await collect(engine, make_request("a2", ids, tenant="alice"))
    assert engine.kv_stats().prefix_hit_tokens > 0


def corrupt_one_block(store):
    key = sorted(store.blocks)[0]
    data = bytearray(store.blocks[key])
    data[-3] ^= 0x40
    store.blocks[key] = bytes(data)


def wrong_shape_blocks(store):
    # Blocks of another model shape (as if written with another block size): a miss.
    from deployments.compute.engines.kv_codec import encode_kv_block

    for key, data in store.blocks.items():
        store.blocks[key] = encode_kv_block(torch.zeros(2, 2, 2, BLOCK, 32))


def fail_load(store):
    store.fail_load = True


def load_none(store):
    store.load_returns_none = True


def fail_lookup(store):
    store.fail_lookup = True


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", [corrupt_one_block, wrong_shape_blocks, fail_load, load_none, fail_lookup])
async def test_store_failure_is_a_miss_with_correct_output(engine, plain, store, damage):
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("prime", ids))
    damage(store)
    before = engine.kv_stats()
    tokens = await collect(engine, make_request("after", ids))
    after = engine.kv_stats()
    assert after.fetch_failures == before.fetch_failures + 1
    assert after.prefix_hit_tokens == before.prefix_hit_tokens  # nothing imported
    assert after.prefilled_tokens - before.prefilled_tokens == len(ids)  # full prefill
    assert tokens == await collect(plain, make_request("ref", ids))
    torch.testing.assert_close(engine.logits_hook.first["after"], plain.logits_hook.first["ref"], atol=1e-4, rtol=0)
    await engine.check_health()


@pytest.mark.asyncio
async def test_slow_tier_is_recomputed_not_fetched(engine, store):
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("prime", ids))
    assert engine.prefill_tokens_per_s() is not None and engine.prefill_tokens_per_s() > 0
    store.bandwidth = 1.0  # 1 byte/s: fetching is measured slower than recomputing
    loads = len(store.loads)
    tokens = await collect(engine, make_request("slow", ids))
    stats = engine.kv_stats()
    assert stats.fetch_skipped == 1 and stats.prefix_hit_tokens == 0 and len(store.loads) == loads
    store.bandwidth = 1e12
    assert await collect(engine, make_request("fast", ids)) == tokens
    assert engine.kv_stats().prefix_hit_tokens > 0


@pytest.mark.asyncio
async def test_a_slow_import_is_recomputed_even_from_a_fast_store(engine, store, monkeypatch):
    """The decision weighs the whole import (load, decode, copy to the device), which the
    engine measures itself, not only the store's transport: on an accelerator the copy
    to the device can cost more than prefilling the tokens again."""
    import time as _time

    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("prime-import", ids))
    store.bandwidth = 1e12  # the store's transport: effectively free
    decode = engine._decode_prefix

    def slow_decode(*args, **kwargs):
        _time.sleep(1.0)  # an import far slower than prefilling ~60 tiny-model tokens
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_prefix", slow_decode)
    before = engine.kv_stats()
    tokens = await collect(engine, make_request("measured", ids))  # imports, and measures it
    mid = engine.kv_stats()
    assert mid.prefix_hit_tokens > before.prefix_hit_tokens and mid.fetch_skipped == before.fetch_skipped
    assert engine.import_bytes_per_s("L2") < store.bandwidth
    assert mid.import_bytes_per_s == {"L2": engine.import_bytes_per_s("L2")}  # what the worker's gauge shows
    loads = len(store.loads)
    assert await collect(engine, make_request("skipped", ids)) == tokens
    after = engine.kv_stats()
    assert after.fetch_skipped == mid.fetch_skipped + 1
    assert after.prefix_hit_tokens == mid.prefix_hit_tokens and len(store.loads) == loads


@pytest.mark.asyncio
async def test_a_prefix_costs_only_its_marginal_prefill_time(engine, store, monkeypatch):
    """A forward pass with a large fixed cost, as a small model's is on a GPU: a prefix of
    48 tokens adds almost nothing to a prefill, so even an import far cheaper than that
    fixed cost is not worth it. (A tokens-per-second average charged every token its share
    of the fixed cost, ~0.4 s for these 48, and kept importing, as measured on an H200.)"""
    import time as _time

    ids = encode(engine, PROMPTS[0])
    forward = engine.model.forward

    def fixed_cost_forward(*args, **kwargs):
        _time.sleep(0.2)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", fixed_cost_forward)
    await run_and_export(engine, make_request("prime-fixed", ids, max_tokens=2))  # a full prefill
    store.bandwidth = 1e12
    decode = engine._decode_prefix

    def import_100ms(*args, **kwargs):
        _time.sleep(0.1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_prefix", import_100ms)
    before = engine.kv_stats()
    tokens = await collect(engine, make_request("imports", ids, max_tokens=2))  # a suffix prefill
    mid = engine.kv_stats()
    assert mid.prefix_hit_tokens > before.prefix_hit_tokens
    imported = mid.prefix_hit_tokens - before.prefix_hit_tokens
    assert engine._prefill_time.marginal_seconds(imported) < 0.05  # ~ms, not the 0.2 s fixed cost
    assert mid.prefill_fixed_seconds > 0.15
    assert await collect(engine, make_request("recomputes", ids, max_tokens=2)) == tokens
    after = engine.kv_stats()
    assert after.fetch_skipped == mid.fetch_skipped + 1 and after.prefix_hit_tokens == mid.prefix_hit_tokens


@pytest.mark.asyncio
async def test_recomputing_a_slow_tier_still_re_measures_it_now_and_then(engine, store):
    from deployments.compute.engines.torch_engine import _EXPLORE_EVERY_SKIPS

    ids = encode(engine, PROMPTS[1])
    await run_and_export(engine, make_request("prime-explore", ids))
    store.bandwidth = 1.0
    before = engine.kv_stats()
    for i in range(_EXPLORE_EVERY_SKIPS + 1):
        await collect(engine, make_request(f"explore{i}", ids))
    after = engine.kv_stats()
    # Skipped in a row up to the limit, then one fetch to measure the tier again.
    assert after.fetch_skipped - before.fetch_skipped == _EXPLORE_EVERY_SKIPS
    assert after.prefix_hit_tokens > before.prefix_hit_tokens


@pytest.mark.asyncio
async def test_one_stalled_import_costs_one_skip_not_a_run_of_them(engine, store, monkeypatch):
    """An import that stalled (here its decode sleeps 1 s once; in loadtests.multiturn one
    decode took 835 ms) sets the tier's figure on its own. The next stored prefix is
    recomputed (one skip, as the figure rests on one import), the one after is imported
    to re-measure, and that fast import replaces the figure instead of being averaged
    with the stall (which kept L2 recomputed for six turns of a conversation)."""
    import time as _time

    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("prime-stall", ids))
    store.bandwidth = 1e12
    decode, stalls = engine._decode_prefix, [1.0]

    def stalled_once(*args, **kwargs):
        if stalls:
            _time.sleep(stalls.pop())
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_prefix", stalled_once)
    before = engine.kv_stats()
    tokens = await collect(engine, make_request("stalled", ids))
    stalled = engine.kv_stats()
    assert stalled.prefix_hit_tokens > before.prefix_hit_tokens and not stalls
    stalled_figure = engine.import_bytes_per_s("L2")
    assert await collect(engine, make_request("skipped-after-stall", ids)) == tokens
    skipped = engine.kv_stats()
    assert skipped.fetch_skipped == stalled.fetch_skipped + 1
    assert skipped.prefix_hit_tokens == stalled.prefix_hit_tokens
    assert await collect(engine, make_request("re-measured", ids)) == tokens
    after = engine.kv_stats()
    assert after.prefix_hit_tokens > skipped.prefix_hit_tokens and after.fetch_skipped == skipped.fetch_skipped
    assert after.import_rate_resets == skipped.import_rate_resets + 1
    assert engine.import_bytes_per_s("L2") > 4 * stalled_figure


@pytest.mark.asyncio
async def test_a_cold_warm_up_is_forgotten_and_stored_prefixes_are_imported_again(engine, store, monkeypatch):
    """The worker's warm-up generation runs while the application's other replicas start:
    its short prefill was measured at 0.84 s there. With that sample least squares fits
    0 s per token, and the engine recomputed stored prefixes (turns 2-6 of a session in
    ``loadtests.multiturn``). The worker calls ``forget_measurements`` after its warm-up."""
    import time as _time

    forward, cold = engine.model.forward, [True]

    def cold_forward(*args, **kwargs):
        if cold[0]:
            cold[0] = False
            _time.sleep(0.5)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", cold_forward)
    await collect(engine, make_request("warm-up", list(range(10, 10 + 16)), max_tokens=2))  # short and slow
    ids = encode(engine, PROMPTS[0])
    assert len(ids) > 2 * 16
    await run_and_export(engine, make_request("prime-cold", ids))  # longer, and fast
    assert engine.prefill_tokens_per_s() is None  # the fit: 0 s per token
    store.bandwidth = 1e12
    before = engine.kv_stats()
    assert await collect(engine, make_request("skipped-cold", ids)) == await collect(engine, make_request("again", ids))
    assert engine.kv_stats().fetch_skipped == before.fetch_skipped + 2
    assert engine.kv_stats().prefix_hit_tokens == before.prefix_hit_tokens

    engine.forget_measurements()
    assert engine.prefill_fixed_seconds() is None and engine.import_bytes_per_s("L2") is None
    before = engine.kv_stats()
    await collect(engine, make_request("imported", ids))
    after = engine.kv_stats()
    assert after.fetch_skipped == before.fetch_skipped
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == (len(ids) - 1) // BLOCK * BLOCK
    # Measured afresh from that import on: recomputing is not free.
    assert engine.prefill_tokens_per_s() is not None


@pytest.mark.asyncio
async def test_the_stores_figures_from_the_warm_up_are_forgotten_too(engine, store):
    """The warm-up prompt is the same on every replica, so a new replica's warm-up finds
    it in the store and reads one block on cold connections: a transport figure so low
    (24 MB/s in ``loadtests.multiturn``) that, with no import figure yet, the first hits
    of sessions were recomputed. ``forget_measurements`` drops the store's figures too."""
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("prime-store", ids))  # and a prefill measured
    assert engine.import_bytes_per_s("L2") is None  # no import yet: the store's figure decides
    store.bandwidth = 1e3  # what a cold one-block read left
    before = engine.kv_stats()
    await collect(engine, make_request("skipped-slow-store", ids))
    assert engine.kv_stats().fetch_skipped == before.fetch_skipped + 1

    engine.forget_measurements()
    assert store.bandwidth_bytes_per_s("L2") is None
    before = engine.kv_stats()
    await collect(engine, make_request("imported-after-forgetting", ids))
    after = engine.kv_stats()
    assert after.fetch_skipped == before.fetch_skipped
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == (len(ids) - 1) // BLOCK * BLOCK


@pytest.mark.asyncio
async def test_start_runs_a_forward_pass_that_nothing_counts(tiny_model_path, monkeypatch):
    """start() pays a fresh process's first-use costs with a throwaway prefill and decode
    step on the engine's thread (a cold 32-token prefill took 4x a warm one on the small
    model); no counter and no measurement sees it, and a failure there fails start()."""
    calls = []
    real = TorchEngine._warm_kernels

    def counted(self):
        calls.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(TorchEngine, "_warm_kernels", counted)
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=1)
    await eng.start()
    try:
        assert calls == ["torch-engine-loop"]
        assert eng.stats().num_steps == 0 and eng.stats().num_generated_tokens == 0
        assert eng.prefill_fixed_seconds() is None and eng.kv_stats().prefilled_tokens == 0
        assert len(await collect(eng, make_request("after-warm", [5, 6, 7], max_tokens=3))) == 3
    finally:
        await eng.shutdown()

    def broken(self):
        raise RuntimeError("no kernel for this machine")

    monkeypatch.setattr(TorchEngine, "_warm_kernels", broken)
    failing = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=1)
    with pytest.raises(RuntimeError, match="no kernel"):
        await failing.start()
    with pytest.raises(EngineDeadError):
        await failing.check_health()


@pytest.mark.asyncio
async def test_concurrent_hits_and_misses_match_no_connector(engine, plain, store, monkeypatch):
    # Every hit imported: which hits the fetch-or-recompute decision skips depends on this
    # machine's speed of the minute (under CI's load it skipped 3 of 4), and the tests
    # above check that decision; this one checks concurrent imports against recompute.
    monkeypatch.setattr(engine, "always_fetch", True)
    prompt_ids = [encode(engine, p) for p in PROMPTS]
    max_tokens = [14, 9, 20, 6, 11, 16]
    # Prime the store with half the prompts (so those are hits), one of them extended.
    for i in (0, 2, 3):
        await run_and_export(engine, make_request(f"prime{i}", prompt_ids[i], max_tokens=4))
    prompt_ids[3] = prompt_ids[3] + encode(engine, " and more words after it")[1:]
    before = engine.kv_stats()
    requests = [make_request(f"c{i}", ids, max_tokens=n) for i, (ids, n) in enumerate(zip(prompt_ids, max_tokens))]
    requests += [make_request("c0-again", prompt_ids[0], max_tokens=7)]  # a hit that joins later
    got = await asyncio.gather(*(collect(engine, r) for r in requests))
    refs = await asyncio.gather(*(collect(plain, make_request(r.request_id, r.prompt_token_ids,
                                                              max_tokens=r.sampling.max_tokens)) for r in requests))
    assert got == refs
    after = engine.kv_stats()
    # Prompts 0 (twice) and 2 hit in full; 3 hits on the full blocks of its primed prompt
    # (the primed answer differs from the extension); 1, 4 and 5 miss.
    expected_hit = sum((len(prompt_ids[i]) - 1) // BLOCK * BLOCK for i in (0, 2, 0))
    expected_hit += len(encode(engine, PROMPTS[3])) // BLOCK * BLOCK
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == expected_hit
    assert after.fetch_failures == 0
    for r in requests:
        torch.testing.assert_close(engine.logits_hook.first[r.request_id], plain.logits_hook.first[r.request_id],
                                   atol=1e-4, rtol=0)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


@pytest.mark.asyncio
async def test_aborted_request_exports_nothing(engine, store):
    ids = encode(engine, PROMPTS[0])
    stream = engine.generate(make_request("cancel", ids, max_tokens=500))
    await stream.__anext__()
    await stream.aclose()
    await asyncio.sleep(0.2)
    await engine.wait_for_kv_exports()
    assert not store.blocks and engine.kv_stats().blocks_exported == 0


@pytest.mark.asyncio
async def test_waiting_for_exports_returns_while_a_finished_one_is_still_listed(engine):
    """A finished export stays in the engine's set until its done callback runs on a later
    turn of the loop. Waiting must not spin on it: on Python 3.12, whose ``gather`` of
    finished tasks never yields, a shutdown hung that way (H200 machine,
    loadtests/gpu_check.sh). Here the task is listed with no callback at all, so a wait
    that loops until the set is empty never returns on any Python."""

    async def finished():
        return None

    task = asyncio.get_running_loop().create_task(finished())
    await asyncio.sleep(0)
    assert task.done()
    engine._export_tasks.add(task)
    await asyncio.wait_for(engine.wait_for_kv_exports(), 5)
    engine._export_tasks.discard(task)


@pytest.mark.asyncio
async def test_prompt_logprobs_prefill_the_whole_prompt_though_its_prefix_is_cached(engine, plain, store):
    """A prefix in the store has no logits: a request for prompt logprobs imports none
    and prefills it all (vLLM skips its prefix cache for these too); its entries equal
    those of an engine without a cache."""
    ids = plain.tokenizer(PROMPTS[0])["input_ids"]
    await collect(engine, make_request("first", ids))
    await engine.wait_for_kv_exports()
    assert store.blocks
    deltas = [d async for d in engine.generate(make_request("scored", ids, prompt_logprobs=1))]
    ref = [d async for d in plain.generate(make_request("ref", ids, prompt_logprobs=1))]
    assert deltas[-1].num_cached_tokens == 0
    got, want = deltas[0].prompt_logprobs, ref[0].prompt_logprobs
    assert got[0] is None and want[0] is None and len(got) == len(ids)
    assert [e[0] for e in got[1:]] == pytest.approx([e[0] for e in want[1:]], abs=1e-5)
    # A plain request of the same prompt still reuses the blocks.
    again = [d async for d in engine.generate(make_request("reuse", ids))]
    assert again[-1].num_cached_tokens > 0
