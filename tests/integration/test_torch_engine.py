"""The torch engine end to end on the tiny checkpoint: exactness against HF generate,
continuous batching, seeds, cancellation, limits and failure."""

import asyncio
import os
import sys
import threading

import pytest
import pytest_asyncio

from deployments.compute.engines.protocol import (
    EngineDeadError,
    EngineError,
    RequestRejected,
)
from deployments.compute.engines.torch_engine import TorchEngine
from tests.fixtures.engines import (
    PROMPTS,
    check_bad_words,
    check_end_signal,
    collect,
    encode,
    hf_greedy,
    make_request,
    start_order,
    thread_nices,
    wait_until,
)

@pytest_asyncio.fixture
async def engine(tiny_model_path):
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=4, num_threads=2)
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.mark.asyncio
async def test_greedy_single_matches_hf_generate(engine, hf_model):
    ids = encode(engine, PROMPTS[1])
    deltas, tokens, text = await collect(engine, make_request("one", ids, max_tokens=24))
    assert tokens == hf_greedy(hf_model, ids, 24)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert deltas[-1].finish_reason in ("stop", "length")
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].num_prompt_tokens == len(ids) and deltas[-1].num_output_tokens == len(tokens)


@pytest.mark.asyncio
async def test_greedy_concurrent_batch_matches_hf_generate(engine, hf_model):
    """Six prompts of different lengths on a 4-slot engine with different max_tokens: some
    wait, join the running batch between steps and leave early, all stay exact."""
    prompt_ids = [encode(engine, p) for p in PROMPTS]
    max_tokens = [20, 8, 30, 12, 25, 16]
    requests = [make_request(f"c{i}", ids, max_tokens=n) for i, (ids, n) in enumerate(zip(prompt_ids, max_tokens))]
    seen_running = []

    async def watch():
        while True:
            seen_running.append(engine.stats().num_running)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    watcher.cancel()
    for ids, n, (_, tokens, _) in zip(prompt_ids, max_tokens, results):
        assert tokens == hf_greedy(hf_model, ids, n)
    assert max(seen_running) <= 4
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


@pytest.mark.asyncio
async def test_seeded_sampling_same_alone_and_in_batch(engine):
    ids = encode(engine, PROMPTS[2])
    seeded = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    _, alone, _ = await collect(engine, make_request("alone", ids, **seeded))
    others = [
        make_request(f"n{i}", encode(engine, p), temperature=0.8, max_tokens=20, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:3])
    ]
    results = await asyncio.gather(
        *(collect(engine, r) for r in others[:2]),
        collect(engine, make_request("batched", ids, **seeded)),
        collect(engine, others[2]),
    )
    assert results[2][1] == alone
    _, other_seed, _ = await collect(engine, make_request("other", ids, **{**seeded, "seed": 99}))
    assert other_seed != alone


@pytest.mark.asyncio
async def test_max_tokens_gives_length_with_exact_count(engine):
    ids = encode(engine, PROMPTS[0])
    deltas, tokens, _ = await collect(engine, make_request("len", ids, max_tokens=7, ignore_eos=True))
    assert len(tokens) == 7
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 7


@pytest.mark.asyncio
async def test_eos_finishes_with_stop(engine):
    ids = encode(engine, PROMPTS[1])
    _, greedy, _ = await collect(engine, make_request("ref", ids, max_tokens=6, ignore_eos=True))
    # Pretend the third greedy token is EOS: the stream must end right there.
    engine._eos_token_ids = engine._eos_token_ids | {greedy[2]}
    first = greedy.index(greedy[2])
    deltas, tokens, _ = await collect(engine, make_request("eos", ids, max_tokens=6))
    assert tokens == greedy[: first + 1]
    assert deltas[-1].finish_reason == "stop"
    _, ignored, _ = await collect(engine, make_request("ign", ids, max_tokens=6, ignore_eos=True))
    assert ignored == greedy


@pytest.mark.asyncio
async def test_stop_string_truncates_output(engine):
    ids = encode(engine, PROMPTS[4])
    _, _, full = await collect(engine, make_request("full", ids, max_tokens=30, ignore_eos=True))
    stop = full[10:13]
    assert len(stop) == 3
    expected = full[: full.index(stop)]
    deltas, _, text = await collect(engine, make_request("stop", ids, max_tokens=30, ignore_eos=True, stop=[stop]))
    assert text == expected
    assert deltas[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)


@pytest.mark.asyncio
async def test_too_long_prompt_is_rejected_before_any_delta(engine):
    ids = encode(engine, PROMPTS[0]) * 700  # ~1400 tokens of a 2048 context
    request = make_request("long", ids, max_tokens=1000)
    stream = engine.generate(request)
    with pytest.raises(RequestRejected) as exc:
        await stream.__anext__()
    message = str(exc.value)
    assert str(len(ids)) in message and "1000" in message and str(engine.max_model_len) in message
    assert engine.stats().num_waiting == 0 and engine.stats().num_running == 0


@pytest.mark.asyncio
async def test_closing_the_stream_frees_the_slot(engine):
    ids = encode(engine, PROMPTS[1])
    stream = engine.generate(make_request("cancel", ids, max_tokens=1500, ignore_eos=True))
    first = await stream.__anext__()
    assert first.finish_reason is None
    assert engine.stats().num_running == 1
    await stream.aclose()
    assert await wait_until(lambda: engine.stats().num_running == 0, timeout_s=2.0)
    generated = engine.stats().num_generated_tokens
    await asyncio.sleep(0.1)
    assert engine.stats().num_generated_tokens == generated  # nothing runs any more


@pytest.mark.asyncio
async def test_cancelling_the_consumer_task_frees_the_slot(engine):
    ids = encode(engine, PROMPTS[2])
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(make_request("task", ids, max_tokens=1500, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until(lambda: engine.stats().num_running == 0, timeout_s=2.0)
    # The engine still serves.
    _, tokens, _ = await collect(engine, make_request("after", ids, max_tokens=3, ignore_eos=True))
    assert len(tokens) == 3


@pytest.mark.asyncio
async def test_slow_consumer_gets_coalesced_deltas(engine):
    ids = encode(engine, PROMPTS[1])
    fast = []
    async for delta in engine.generate(make_request("fast", ids, max_tokens=40, ignore_eos=True, logprobs=1)):
        fast.append(delta)
    expected = [t for d in fast for t in d.token_ids]
    deltas = []
    async for delta in engine.generate(make_request("slow", ids, max_tokens=40, ignore_eos=True, logprobs=1)):
        deltas.append(delta)
        await asyncio.sleep(0.05)
    assert len(deltas) < 40
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == "".join(d.text for d in fast)
    assert deltas[-1].num_output_tokens == 40
    # Each token keeps its own logprobs entry through the merge (greedy: the top one).
    entries = [e for d in deltas for e in d.logprobs]
    assert [top[0][0] for _, top in entries] == expected
    assert [lp for lp, _ in entries] == pytest.approx([lp for d in fast for lp, _ in d.logprobs], abs=1e-5)


@pytest.mark.asyncio
async def test_loop_failure_fails_requests_and_health(engine):
    await engine.check_health()
    assert engine.capabilities.continuous_batching

    def broken_forward(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    engine.model.forward = broken_forward
    with pytest.raises(EngineError, match="simulated kernel failure"):
        await collect(engine, make_request("boom", encode(engine, PROMPTS[0])))
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await collect(engine, make_request("after", encode(engine, PROMPTS[0])))


@pytest.mark.asyncio
async def test_bad_parameters_are_rejected(engine):
    ids = encode(engine, PROMPTS[0])
    for bad, param in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(RequestRejected) as exc:
            await collect(engine, make_request("bad", ids, **bad))
        assert exc.value.param == param
    with pytest.raises(RequestRejected):
        await collect(engine, make_request("empty", []))


FIRST_STRUCTURED_REQUESTS = """
import asyncio, sys
from deployments.compute.engines.protocol import GenerationRequest, SamplingParams
from deployments.compute.engines.torch_engine import TorchEngine

async def main():
    engine = TorchEngine(sys.argv[1], max_num_seqs=4, num_threads=1)
    await engine.start()
    assert "transformers.models.auto" not in sys.modules, "the test needs a process without it"

    async def one(i):
        params = SamplingParams(max_tokens=4, temperature=0.0, structured_output=("choice", ["yes", "no"]))
        return [d async for d in engine.generate(GenerationRequest(f"r{i}", [5, 6, 7], params))]

    outs = await asyncio.gather(*(one(i) for i in range(4)))
    await engine.shutdown()
    print("ok", len(outs))

asyncio.run(main())
"""


def test_the_first_structured_requests_at_once_all_get_the_grammar(tiny_model_path):
    """Made by each first request in its own thread, the grammar compiler imported
    transformers from several threads at once, and one request failed with an
    ImportError (a fresh process: the import happens only once)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", FIRST_STRUCTURED_REQUESTS, str(tiny_model_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0 and "ok 4" in out.stdout, out.stderr[-2000:]


@pytest.mark.asyncio
async def test_a_grammar_that_compiles_too_long_is_refused_and_the_engine_goes_on(engine, monkeypatch):
    import time

    import deployments.compute.engines.torch_engine as torch_engine

    ids = encode(engine, PROMPTS[0])
    # The compiler exists after a first structured request.
    await collect(engine, make_request("first", ids, max_tokens=4, structured_output=("choice", ["a", "b"])))
    slow_compile = engine._grammar.compile

    def slow(kind, spec):
        time.sleep(0.5)
        return slow_compile(kind, spec)

    monkeypatch.setattr(engine._grammar, "compile", slow)
    monkeypatch.setattr(torch_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 0.05)
    with pytest.raises(RequestRejected, match="took over") as exc:
        await collect(engine, make_request("slow", ids, structured_output=("regex", "[0-9]+")))
    assert exc.value.param == "response_format"
    _, tokens, _ = await collect(engine, make_request("after", ids, max_tokens=3, ignore_eos=True))
    assert len(tokens) == 3


@pytest.mark.asyncio
async def test_shutdown_ends_in_flight_requests_with_an_error(engine):
    stream = engine.generate(make_request("inflight", encode(engine, PROMPTS[1]), max_tokens=1500, ignore_eos=True))
    await stream.__anext__()
    await engine.shutdown()
    with pytest.raises(EngineError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        await engine.check_health()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.asyncio
async def test_cpu_nice_lowers_the_loop_and_its_compute_threads_only(tiny_model_path):
    """cpu_nice lowers the engine loop thread before its first forward pass, so the
    OpenMP threads it makes for its 2-thread forward passes inherit it; the caller's
    threads keep their priority."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = set(thread_nices())
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=2, device="cpu", cpu_nice=3)
    await eng.start()
    try:
        await collect(eng, make_request("n", encode(eng, PROMPTS[0]), max_tokens=4))
        nice = thread_nices()
        assert nice[eng._thread.native_id] == min(19, base + 3)
        new_lowered = [t for t, n in nice.items() if t not in before and n == min(19, base + 3)]
        assert len(new_lowered) >= 2, (nice, eng._thread.native_id)  # the loop and an OpenMP worker
        assert nice[threading.get_native_id()] == base
    finally:
        await eng.shutdown()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy, want", [("fcfs", [0, 1, 2, 3]), ("priority", [1, 3, 2, 0])])
async def test_waiting_requests_start_by_priority_under_the_priority_policy(tiny_model_path, policy, want):
    """Under ``priority`` the lowest value starts first, arrival order among equals;
    under ``fcfs`` (the default) arrival order alone."""
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=2, scheduling_policy=policy)
    await eng.start()
    try:
        ids = encode(eng, PROMPTS[0])
        order = await start_order(eng, ids, [5, -1, 0, -1], slots=2, max_tokens=eng.max_model_len - len(ids) - 1)
    finally:
        await eng.shutdown()
    assert order == want


@pytest.mark.asyncio
async def test_it_signals_each_requests_end_before_the_last_delta_is_read(engine):
    await check_end_signal(engine, encode(engine, PROMPTS[4]))


@pytest.mark.asyncio
async def test_bad_words_are_ruled_out_of_the_reply(engine):
    await check_bad_words(engine, encode(engine, PROMPTS[1]))
    # A word that makes no token is refused (the ingress refuses it first, as vLLM does).
    with pytest.raises(RequestRejected) as e:
        await collect(engine, make_request("bw-empty", encode(engine, PROMPTS[1]), bad_words=["   "]))
    assert e.value.param == "bad_words"


def test_cpu_nice_out_of_range_is_rejected(tiny_model_path):
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="cpu_nice"):
            TorchEngine(str(tiny_model_path), cpu_nice=bad)


@pytest.mark.asyncio
async def test_warmup_prefill_runs_on_the_loop_thread_before_start_returns(tiny_model_path, monkeypatch, caplog):
    """``warmup_prefill_tokens``: after the short warm-up, one prefill that long (capped
    below the context), on the loop thread that serves requests (the allocator's memory it
    grows is that thread's), before ``start()`` returns; and a DEBUG line per prefill
    with its page faults."""
    calls = []
    original = TorchEngine._warm_prefill

    def spy(self, n, *, decode):
        calls.append((n, decode, threading.get_ident()))
        return original(self, n, decode=decode)

    monkeypatch.setattr(TorchEngine, "_warm_prefill", spy)
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=1, device="cpu", warmup_prefill_tokens=1 << 20)
    assert eng.warmup_prefill_tokens == eng.max_model_len - 1
    caplog.set_level("DEBUG", logger="ray.serve")
    await eng.start()
    try:
        assert [(n, d) for n, d, _ in calls] == [(32, True), (eng.max_model_len - 1, False)]
        assert {t for _, _, t in calls} == {eng._thread.ident}
        assert f"warm-up prefill of {eng.max_model_len - 1} tokens" in caplog.text
        await collect(eng, make_request("w", encode(eng, PROMPTS[0]), max_tokens=2))
        assert "prefill: requests=w rows=1 " in caplog.text and " faults=" in caplog.text
    finally:
        await eng.shutdown()

    calls.clear()
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=2, num_threads=1, device="cpu", warmup_prefill_tokens=0)
    await eng.start()
    await eng.shutdown()
    assert [(n, d) for n, d, _ in calls] == [(32, True)]
    with pytest.raises(ValueError, match="warmup_prefill_tokens"):
        TorchEngine(str(tiny_model_path), warmup_prefill_tokens=-1)


def test_the_config_sets_the_warmup_prefill_unless_warmup_is_off(tiny_model_path):
    from app.config import AppConfig
    from deployments.compute.engines import create_engine

    def built(engine: dict) -> TorchEngine:
        cfg = AppConfig.model_validate({"model": {"path": str(tiny_model_path)}, "engine": {"device": "cpu", **engine}})
        return create_engine(cfg)

    assert built({}).warmup_prefill_tokens == 0  # off by default
    assert built({"warmup_prefill_tokens": 4096}).warmup_prefill_tokens == 2047  # below the tiny model's context
    assert built({"warmup_prefill_tokens": 512}).warmup_prefill_tokens == 512
    assert built({"warmup_prefill_tokens": 512, "warmup": False}).warmup_prefill_tokens == 0


@pytest.mark.asyncio
async def test_prompt_logprobs_are_the_models_own_over_the_whole_prompt(engine, hf_model):
    """vLLM's prompt logprobs: each prompt token's log-probability given the ones before
    it, its rank and the top k, against a full forward pass of transformers' model; the
    request prefills apart from a plain one that arrives with it, and both replies stay
    exact."""
    import torch

    ids, other = encode(engine, PROMPTS[2]), encode(engine, PROMPTS[1])
    (deltas, tokens, _), (_, other_tokens, _) = await asyncio.gather(
        collect(engine, make_request("plp", ids, max_tokens=6, prompt_logprobs=3)),
        collect(engine, make_request("plain", other, max_tokens=6)),
    )
    assert tokens == hf_greedy(hf_model, ids, 6) and other_tokens == hf_greedy(hf_model, other, 6)
    entries = deltas[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert len(entries) == len(ids) and entries[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j in range(1, len(ids)):
        lp, rank, top = entries[j]
        row = ref[j - 1]
        assert lp == pytest.approx(float(row[ids[j]]), abs=1e-4)
        assert rank == int((row > row[ids[j]] + 1e-4).sum()) + 1
        assert [i for i, _ in top] == row.topk(3).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.asyncio
async def test_prompt_logprobs_of_a_reply_are_the_logprobs_it_was_generated_with(engine):
    """The same distributions two ways: a greedy reply's per-token logprobs (decode steps
    over the cache) and the prompt logprobs of the prompt followed by that reply (one
    prefill)."""
    ids = encode(engine, PROMPTS[3])
    deltas, tokens, _ = await collect(engine, make_request("gen", ids, max_tokens=10, ignore_eos=True, logprobs=2))
    generated = [e for d in deltas for e in d.logprobs]
    deltas2, _, _ = await collect(engine, make_request("again", ids + tokens, max_tokens=1, prompt_logprobs=2))
    scored = deltas2[0].prompt_logprobs[len(ids):]
    assert [lp for lp, _, _ in scored] == pytest.approx([lp for lp, _ in generated], abs=1e-4)
    assert [rank for _, rank, _ in scored] == [1] * len(tokens)  # greedy: each the most likely
    assert [[i for i, _ in top] for _, _, top in scored] == [[i for i, _ in top] for _, top in generated]
