"""Iteration-level scheduler: which sequences run in the next engine step.

Pure bookkeeping (no torch, no threads), so every state is unit-testable. The engine's
loop owns one scheduler and is its only caller; each step it:

1. ``schedule()`` — admits waiting sequences while fewer than ``max_num_seqs`` run (in
   arrival order; by ``priority``, lowest first, then arrival, under the ``priority``
   policy); returns the newly admitted ones (to prefill) and all running ones (to decode);
2. runs the model and appends one token per running sequence (``append_token``);
3. ``finish()`` / ``abort()`` — a sequence that is done leaves the running set at once,
   so its slot is free for the very next ``schedule()``.

New sequences therefore join the running batch between decode steps, never mid-step.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class SequenceTooLong(ValueError):
    """Prompt plus ``max_tokens`` exceed the context length."""


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raise :class:`SequenceTooLong` unless the whole sequence fits the context."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise SequenceTooLong(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
            f"{num_prompt_tokens + max_tokens} tokens, more than the model's context "
            f"length of {max_model_len} tokens"
        )


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Under the ``priority`` policy: lower starts sooner (vLLM's meaning).
    priority: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_done(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)


@dataclass(slots=True)
class SchedulerOutput:
    # Admitted this step: their prompts must be prefilled before they can decode.
    prefill: list[Sequence]
    # Every running sequence after admission (includes ``prefill``), in batch order.
    running: list[Sequence]


POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, max_num_seqs: int, max_model_len: int, policy: str = "fcfs"):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Optional[Sequence]:
        return self._by_id.get(request_id)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"duplicate request_id {seq.request_id!r}")
        if not seq.prompt_token_ids:
            raise ValueError("empty prompt")
        check_fits(len(seq.prompt_token_ids), seq.max_tokens, self.max_model_len)
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            # After every waiting sequence of the same or a lower priority value (arrival
            # order among equals); the common case, all equal, is an append.
            i = len(self.waiting)
            while i and self.waiting[i - 1].priority > seq.priority:
                i -= 1
            self.waiting.insert(i, seq)
        else:
            self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def schedule(self) -> SchedulerOutput:
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return SchedulerOutput(prefill=admitted, running=list(self.running))

    def append_token(self, seq: Sequence, token_id: int) -> None:
        seq.output_token_ids.append(token_id)

    def finish(self, seq: Sequence) -> None:
        self._remove(seq, SequenceStatus.FINISHED)

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Drop a request wherever it is; returns it, or None if unknown/already gone."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._remove(seq, SequenceStatus.ABORTED)
        return seq

    def abort_all(self) -> list[Sequence]:
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            self._remove(seq, SequenceStatus.ABORTED)
        return seqs

    def _remove(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        self._by_id.pop(seq.request_id, None)
