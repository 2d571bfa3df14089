"""Exact-state tests of the iteration-level scheduler."""

import pytest

from deployments.compute.engines.scheduler import (
    Scheduler,
    Sequence,
    SequenceStatus,
    SequenceTooLong,
    check_fits,
)


def create_seqs(n: int, prompt_len: int = 4, max_tokens: int = 8) -> list[Sequence]:
    return [Sequence(f"r{i}", list(range(1, prompt_len + 1)), max_tokens) for i in range(n)]


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_admission_is_capped_and_fifo():
    sched = Scheduler(max_num_seqs=2, max_model_len=64)
    for s in create_seqs(3):
        sched.add(s)
    out = sched.schedule()
    assert ids(out.prefill) == ["r0", "r1"]
    assert ids(out.running) == ["r0", "r1"]
    assert ids(sched.waiting) == ["r2"]
    assert sched.get("r2").status is SequenceStatus.WAITING
    # Nothing new is admitted while the batch is full.
    out = sched.schedule()
    assert out.prefill == [] and ids(out.running) == ["r0", "r1"]


def test_finished_leaves_at_once_and_waiting_joins_next_step():
    sched = Scheduler(max_num_seqs=2, max_model_len=64)
    seqs = create_seqs(3)
    for s in seqs:
        sched.add(s)
    sched.schedule()
    sched.append_token(seqs[0], 7)
    sched.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED
    assert ids(sched.running) == ["r1"]
    assert sched.get("r0") is None
    out = sched.schedule()
    assert ids(out.prefill) == ["r2"]
    assert ids(out.running) == ["r1", "r2"]
    assert sched.num_waiting == 0 and sched.num_running == 2


def test_join_between_steps():
    sched = Scheduler(max_num_seqs=4, max_model_len=64)
    first, second = create_seqs(2)
    sched.add(first)
    assert ids(sched.schedule().prefill) == ["r0"]
    sched.add(second)
    assert second.status is SequenceStatus.WAITING  # not running until the next schedule()
    out = sched.schedule()
    assert ids(out.prefill) == ["r1"] and ids(out.running) == ["r0", "r1"]


def test_abort_running_and_waiting():
    sched = Scheduler(max_num_seqs=1, max_model_len=64)
    seqs = create_seqs(3)
    for s in seqs:
        sched.add(s)
    sched.schedule()
    assert sched.abort("r0") is seqs[0]
    assert seqs[0].status is SequenceStatus.ABORTED
    assert sched.abort("r2") is seqs[2]
    assert ids(sched.waiting) == ["r1"] and sched.running == []
    assert sched.abort("r0") is None and sched.abort("nope") is None
    out = sched.schedule()
    assert ids(out.prefill) == ["r1"]
    assert [s.request_id for s in sched.abort_all()] == ["r1"]
    assert not sched.has_work()


def test_length_checks():
    check_fits(60, 4, 64)  # exactly fits
    with pytest.raises(SequenceTooLong) as exc:
        check_fits(60, 5, 64)
    assert "60" in str(exc.value) and "5" in str(exc.value) and "64" in str(exc.value)
    sched = Scheduler(max_num_seqs=1, max_model_len=16)
    with pytest.raises(SequenceTooLong):
        sched.add(Sequence("long", list(range(10)), max_tokens=7))
    assert not sched.has_work()


def test_rejects_duplicates_and_empty_prompts():
    sched = Scheduler(max_num_seqs=2, max_model_len=64)
    sched.add(create_seqs(1)[0])
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(create_seqs(1)[0])
    with pytest.raises(ValueError, match="empty"):
        sched.add(Sequence("e", [], 4))
    with pytest.raises(ValueError):
        Scheduler(max_num_seqs=0, max_model_len=64)


def test_num_tokens_counts_prompt_and_output():
    seq = create_seqs(1, prompt_len=5)[0]
    sched = Scheduler(max_num_seqs=1, max_model_len=64)
    sched.add(seq)
    sched.schedule()
    sched.append_token(seq, 3)
    sched.append_token(seq, 4)
    assert seq.num_tokens == 7 and seq.output_token_ids == [3, 4]


@pytest.mark.parametrize("policy, want", [("fcfs", ["r0", "r1", "r2", "r3", "r4"]),
                                          ("priority", ["r1", "r3", "r2", "r4", "r0"])])
def test_the_priority_policy_admits_the_lowest_value_first_and_equals_in_arrival_order(policy, want):
    sched = Scheduler(max_num_seqs=1, max_model_len=64, policy=policy)
    for s, priority in zip(create_seqs(5), [5, -1, 0, -1, 0]):
        s.priority = priority
        sched.add(s)
    assert ids(sched.waiting) == want
    started = []
    while sched.has_work():
        [seq] = sched.schedule().prefill
        started.append(seq.request_id)
        sched.finish(seq)
    assert started == want
    # An abort takes a waiting sequence out of the order, wherever it is.
    for s, priority in zip(create_seqs(3), [2, 1, 0]):
        s.priority = priority
        sched.add(s)
    sched.abort("r1")
    assert ids(sched.waiting) == (["r0", "r2"] if policy == "fcfs" else ["r2", "r0"])


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        Scheduler(max_num_seqs=1, max_model_len=64, policy="lifo")
