"""The torch engine: Hugging Face checkpoints with continuous (iteration-level) batching
(Llama on the engine's own model, llama.py; other architectures through transformers).

One background thread runs the engine loop, because a forward pass blocks; the asyncio
side only enqueues commands and reads per-request result queues. Each step:

    admit waiting → prefill the admitted (one left-padded batch) → one decode step for
    the sequences that were already running (one batched forward) → merge the new
    sequences' KV into the running batch → emit deltas; finished/aborted rows leave.

KV layout: one cache (``kv_buffer.growable_cache``) for the whole running batch, ``[batch, heads, T, dim]``
per layer, left-padded, with a ``[batch, T]`` attention mask marking real positions. Its
layers append in place (``kv_buffer.GrowableLayer``: room behind the cached tokens, grown
by a quarter when full) instead of concatenating the whole cache at every step.
Position ids are each sequence's own token count, so padding never shifts RoPE and a
sequence decodes the same tokens alone or in any batch (up to float rounding).

KV reuse (optional ``kv_connector``): before a request is handed to the loop thread,
``generate()`` looks up the chained block hashes of its prompt (all but the last token, so
at least one token is prefilled and yields logits), fetches the leading blocks the store
holds (unless :func:`should_fetch` says recomputing is faster) and decodes them. The loop
thread prefills such a request alone (batch of 1) on a cache pre-filled with the imported
K/V, feeding only the remaining prompt tokens at positions ``P..``; its row then merges
into the running batch like any other. When a request finishes (stop/length), the full
blocks of its processed tokens that were not imported are copied out of the cache and
encoded and saved on the asyncio side. Any KV-store failure is a miss, never a failed request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

import torch

from app.host_memory import minor_faults, process_minor_faults
from deployments.compute.engines import kv_arena, llama, lora
from deployments.compute.engines.detokenizer import IncrementalDetokenizer
from deployments.compute.engines.kv import (
    TIER_L1,
    CheckedBlocks,
    KVConnector,
    PrefillTimeModel,
    PrefixHit,
    Rate,
    block_hashes,
    prompt_lookup_hashes,
    should_fetch,
)
from deployments.compute.engines.kv_buffer import (
    DECODE_ROOM_TOKENS,
    empty_with_room,
    growable_cache,
    with_room,
)
from deployments.compute.engines.kv_codec import (
    CorruptBlockError,
    block_shape,
    decode_kv_blocks,
    encode_kv_blocks,
)
from deployments.compute.engines.protocol import (
    Engine,
    EngineCapabilities,
    EngineDeadError,
    EngineError,
    EngineStats,
    GenerationRequest,
    RequestRejected,
    TokenDelta,
    TokenLogprobs,
    validate_request,
)
from deployments.compute.engines.bad_words import bad_words_token_ids, banned_tokens
from deployments.compute.engines.sampling import (
    adjust_logits,
    adjusts_logits,
    make_generator,
    prompt_logprobs,
    sample,
    token_logprobs,
)
from deployments.compute.engines.scheduler import Scheduler, Sequence
from deployments.compute.engines.structured import Constraint, GrammarCompiler

logger = logging.getLogger("ray.serve")  # the replica's Serve log (a module logger had no handler: INFO lines were lost)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_IMPLS = ("auto", "native", "transformers")
# Decode fetched blocks in a worker thread above this size, not on the event loop.
_DECODE_INLINE_MAX_BYTES = 256 * 1024


# After this many recomputed hits in a row on one tier, fetch once to re-measure it.
_EXPLORE_EVERY_SKIPS = 4
# How long a structured-output grammar may take to compile before the request is refused
# (vLLM's VLLM_REGEX_COMPILATION_TIMEOUT_S, for its regexes, is of this order).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0

# Tokens of the throwaway forward pass that start() runs (_warm_kernels).
WARM_UP_TOKENS = 32


@dataclass(slots=True)
class KVStats:
    """KV-reuse counters of one engine (cumulative since construction)."""

    # Requests whose prompt had at least one full block to look up.
    lookups: int = 0
    # Prompt tokens whose K/V came from the store instead of a prefill.
    prefix_hit_tokens: int = 0
    blocks_imported: int = 0
    # Prompt tokens computed by prefill (every request, with or without a prefix hit).
    prefilled_tokens: int = 0
    # A hit that was not fetched because recomputing was measured to be faster.
    fetch_skipped: int = 0
    # Imports over 4x faster than a tier's measured figure, which then restarted from
    # them (engines/kv.py:Rate; a stalled import, or smaller ones, had set it).
    import_rate_resets: int = 0
    # Data-plane lookups not made: the router's root index said no stored chain starts
    # with the prompt's first block (GenerationRequest.kv_lookup_skip).
    lookups_skipped: int = 0
    # Lookup/load raised, load returned None, or a block failed to decode.
    fetch_failures: int = 0
    blocks_exported: int = 0
    export_failures: int = 0
    # Prompt tokens whose K/V came from this worker's own L1 prefix cache (a subset of
    # prefix_hit_tokens, which counts every reused token).
    l1_hit_tokens: int = 0
    # Blocks dropped from L1 because their session was deleted (drop_cached_blocks).
    l1_dropped_blocks: int = 0
    # The process's KV arena (kv_arena.py): buffers it had no room for (they came from
    # malloc), and its bytes in use and in all; 0 while there is none.
    arena_fallbacks: int = 0
    arena_used_bytes: int = 0
    arena_capacity_bytes: int = 0
    # Measured prefill time = fixed + tokens / prefill_tokens_per_s (PrefillTimeModel):
    # the marginal speed, what recomputing a cached prefix runs at; None until measured.
    prefill_tokens_per_s: Optional[float] = None
    prefill_fixed_seconds: Optional[float] = None
    # Per tier (L1, L2, L3): measured import speed (stored bytes per second: load, decode,
    # copy to the device), what the fetch-or-recompute decision weighs; measured tiers only.
    import_bytes_per_s: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Request:
    """Engine-side state of one request; touched only by the loop thread after submit."""

    seq: Sequence
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    generator: Optional[torch.Generator]
    loop: asyncio.AbstractEventLoop
    results: asyncio.Queue
    # Sampled but not yet fed through the model (its K/V are not in the cache yet).
    pending_token_id: int = -1
    # That token's logprobs, when the request asked for them.
    pending_logprobs: Optional[TokenLogprobs] = None
    # The grammar the reply is held to (structured output), if any.
    constraint: Optional[Constraint] = None
    done: bool = False
    # Imported K/V of the first P prompt tokens, [layers, 2, kv_heads, P, head_dim] on CPU;
    # dropped once prefilled.
    prefix: Optional[torch.Tensor] = None
    # P, once prefilled with a prefix (its blocks are not exported again).
    num_imported_tokens: int = 0
    # The prompt's logprobs (SamplingParams.prompt_logprobs), from its prefill until the
    # first delta carries them.
    prompt_logprobs: Optional[list] = None
    # SamplingParams.bad_words as token sequences (bad_words.bad_words_token_ids).
    bad_words: list = field(default_factory=list)
    # Done (on ``loop``) with the last item handed over: the finishing delta or an error
    # (Engine.end_signal). Made in generate, on ``loop``.
    ended: Optional[asyncio.Future] = None

    def hand_over(self, item: Union[TokenDelta, BaseException]) -> None:
        """On ``loop``: queue ``item`` for ``generate``; the last one completes ``ended``."""
        self.results.put_nowait(item)
        if (isinstance(item, BaseException) or item.finish_reason is not None) and not self.ended.done():
            self.ended.set_result(None)


@dataclass(slots=True)
class _Add:
    req: _Request


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    pass


_Command = Union[_Add, _Abort, _Stop]


@dataclass(slots=True)
class _Batch:
    """The running batch's KV cache; row i belongs to ``reqs[i]``."""

    reqs: list[_Request] = field(default_factory=list)
    cache: Optional[object] = None  # kv_buffer.growable_cache()
    mask: Optional[torch.Tensor] = None  # [batch, T], 1 = real token


def lower_thread_priority(increment: int) -> Optional[int]:
    """Raise the calling thread's nice value by ``increment`` (at most to 19); the new
    value, or None where it could not (Linux only: there nice belongs to a thread, and a
    thread it starts inherits it)."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        logger.warning("torch engine: could not lower its threads' priority: %s", e)
        return None
    return nice


class TorchEngine(Engine):
    capabilities = EngineCapabilities(
        continuous_batching=True, wants_router_batching=True, supports_kv_export=True
    )

    def __init__(
        self,
        model_path: str,
        *,
        max_num_seqs: int = 32,
        device: str = "auto",
        dtype: str = "float32",
        num_threads: Optional[int] = None,
        max_model_len: Optional[int] = None,
        kv_connector: Optional[KVConnector] = None,
        model_id: str = "model",
        block_size: int = 16,
        prefix_cache_bytes: int = 0,
        always_fetch: bool = False,
        model_impl: str = "auto",
        cpu_nice: int = 0,
        kv_arena_bytes: int = 0,
        warmup_prefill_tokens: int = 0,
        cudnn_attention: bool = False,
        scheduling_policy: str = "fcfs",
        lora_modules: Optional[dict[str, str]] = None,
    ):
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= cpu_nice <= 19:
            raise ValueError(f"cpu_nice must be in [0, 19], got {cpu_nice}")
        if kv_arena_bytes < 0:
            raise ValueError(f"kv_arena_bytes must be >= 0, got {kv_arena_bytes}")
        if warmup_prefill_tokens < 0:
            raise ValueError(f"warmup_prefill_tokens must be >= 0, got {warmup_prefill_tokens}")
        connector_block_size = getattr(kv_connector, "block_size", None)
        if connector_block_size is not None and connector_block_size != block_size:
            raise ValueError(
                f"kv_connector.block_size is {connector_block_size}, the engine's block_size is {block_size}"
            )
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_path = str(model_path)
        self.max_num_seqs = max_num_seqs
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.num_threads = num_threads
        self.cpu_nice = cpu_nice
        self.cudnn_attention = cudnn_attention
        # The model runs natively (llama.py: no transformers import, a replica starts in
        # half the time) where it can, else through transformers.
        why = llama.checkpoint_unsupported(self.model_path)
        if model_impl == "native" and why is not None:
            raise ValueError(f"model_impl native cannot run {self.model_path}: {why}")
        self.model_impl = "transformers" if model_impl == "transformers" or why is not None else "native"
        if self.model_impl == "native":
            self.config = llama.LlamaConfig.from_dict(llama.read_json(Path(self.model_path) / "config.json"))
        else:
            from transformers import AutoConfig

            self.config = AutoConfig.from_pretrained(self.model_path)
            if model_impl == "auto":
                logger.info("torch engine: %s runs through transformers (%s)", self.model_path, why)
        # LoRA adapters (engines/lora.py), applied per row by the native model; slot i + 1
        # of the model's lora_rows is adapter i.
        self.lora_adapters = [lora.read_adapter(name, path) for name, path in (lora_modules or {}).items()]
        self._lora_slots = {a.name: i for i, a in enumerate(self.lora_adapters, start=1)}
        if self.lora_adapters and self.model_impl != "native":
            raise ValueError(
                f"LoRA adapters need the native model (engine.model_impl native or auto); "
                f"{self.model_path} runs through transformers ({why or 'model_impl transformers'})"
            )
        self.tokenizer = self._new_tokenizer()
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self._requested_impl = model_impl
        self._hf_cache = self.model_impl == "transformers"
        self.model = None
        self._loop_tokenizer = None
        # Structured output's grammar compiler, made at the first request that needs one.
        self._grammar: Optional[GrammarCompiler] = None
        self._grammar_lock = asyncio.Lock()

        self._scheduler = Scheduler(max_num_seqs, self.max_model_len, scheduling_policy)
        self._batch = _Batch()
        # Waiting and running requests, by id (loop thread only).
        self._reqs_by_id: dict[str, _Request] = {}
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Guards "is the loop alive" against submissions, so nothing is enqueued after
        # the loop's last drain and left hanging.
        self._lifecycle_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._dead: Optional[BaseException] = None
        # The requests generate() is streaming, each with its _Request.ended (end_signal).
        self._active: dict[str, asyncio.Future] = {}
        self._eos_token_ids: set[int] = set()
        # Written by the loop thread only; read by stats().
        self._num_submitted = 0
        self._num_seen = 0
        self._num_steps = 0
        self._num_generated_tokens = 0
        self._num_cached_tokens = 0

        # KV reuse. The block hashes cover model_id and tenant, not the dtype: give engines
        # of different dtypes different model_ids (a mismatch is only ever a miss).
        self._kv = kv_connector
        self.model_id = model_id
        self.block_size = block_size
        self._kv_block_shape = block_shape(self.config, block_size)
        self._kv_stats = KVStats()
        # On a CPU, the KV buffers come from an arena of pages touched once (kv_arena.py),
        # no larger than what max_num_seqs sequences of max_model_len tokens (with a
        # quarter of room, kv_buffer.room_for) can hold at once.
        self.kv_arena_bytes = 0
        if self.device.type == "cpu" and kv_arena_bytes > 0:
            most = self.max_num_seqs * (self.max_model_len * 5 // 4) * self._kv_token_bytes()
            self.kv_arena_bytes = min(int(kv_arena_bytes), most)
        # The long prefill of the warm-up (_warm_kernels), within the context (0: none).
        self.warmup_prefill_tokens = min(int(warmup_prefill_tokens), self.max_model_len - 1)
        if self.warmup_prefill_tokens <= WARM_UP_TOKENS:
            self.warmup_prefill_tokens = 0
        # L1 (engines/prefix_cache.py): recent blocks in this process, in front of the
        # connector; part of KV reuse, so only with a connector.
        self._l1 = None
        if kv_connector is not None and prefix_cache_bytes > 0:
            from deployments.compute.engines.prefix_cache import PrefixCache

            self._l1 = PrefixCache(prefix_cache_bytes, block_size)
        # Per tier: stored prefixes recomputed since the last fetch (see _worth_importing),
        # and the measured import rate (bytes, seconds) of each tier.
        self._import_rate: dict[str, Rate] = {}
        # Benchmarks: import every stored prefix, measured or not (loadtests/engine_kv.py).
        self.always_fetch = always_fetch
        self._skips_since_fetch: dict[str, int] = {}
        # Prefill time as fixed + per-token cost: recomputing a cached prefix costs its
        # tokens' per-token part only (see PrefillTimeModel).
        self._prefill_time = PrefillTimeModel()
        self._export_tasks: set[asyncio.Task] = set()
        # Debug/test hook, called on the loop thread after every forward with
        # (request_ids, logits [batch, vocab] float32 CPU, "prefill" | "decode").
        self.logits_hook: Optional[Callable[[list[str], torch.Tensor, str], None]] = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            return
        kv_arena.install(self.kv_arena_bytes)  # populated in the background, beside the load
        await asyncio.to_thread(self._load)
        warmed: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run_loop, args=(warmed,), name="torch-engine-loop", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(warmed)  # raises what failed the first forward pass

    def _new_tokenizer(self):
        if self.model_impl == "native" and llama.FastTokenizer.supports(self.model_path) is None:
            return llama.FastTokenizer(self.model_path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def _load(self) -> None:
        # The loop thread decodes with its own copy: a Rust tokenizer used from two threads
        # at once can fail with "Already borrowed" while the caller encodes.
        self._loop_tokenizer = self._new_tokenizer()
        model = None
        if self.model_impl == "native":
            try:
                model = llama.LlamaForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
            except ValueError as e:
                if self._requested_impl != "auto":
                    raise
                # Weights under names transformers converts (its conversion mappings), say:
                # the checkpoint ran before, it still runs.
                logger.warning("torch engine: %s runs through transformers: the native model cannot load it (%s)",
                               self.model_path, e)
                if self.lora_adapters:
                    raise ValueError(f"LoRA adapters need the native model, which cannot load {self.model_path}: {e}")
                self.model_impl, self._hf_cache = "transformers", True
            eos = llama.read_json(Path(self.model_path) / "generation_config.json").get(
                "eos_token_id", self.config.eos_token_id
            )
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
            eos = model.generation_config.eos_token_id
        if self.device.type == "cuda" and not self.cudnn_attention:
            # SDPA's cuDNN backend (PyTorch's first choice for bf16/fp16 on Hopper) builds
            # an execution graph for each new shape and caches it per thread; here every
            # decode step has a new KV length and every prefill after an import a new mask
            # shape, so it built one per step: medium bf16 on an H200 decoded at 40-71 ms
            # a token and a prefill after an import took 0.66-1.16 s (loadtests/README.md,
            # "The torch engine on an H200 again"). Flash / memory-efficient attention
            # have no such cost. Process-wide: a worker process runs one engine.
            torch.backends.cuda.enable_cudnn_sdp(False)
            logger.info("torch engine: SDPA's cuDNN backend off (per-shape graph builds); flash/efficient attention")
        self.model = model.to(self.device).eval()
        if self.lora_adapters:
            shapes = self.model.lora_shapes()
            self.model.set_adapters([
                {m: (a.to(self.device), b.to(self.device))
                 for m, (a, b) in lora.load_weights(info, self.config.num_hidden_layers, shapes).items()}
                for info in self.lora_adapters
            ])
            logger.info("torch engine: LoRA adapters %s", ", ".join(
                f"{a.name} (rank {a.rank}, {a.path})" for a in self.lora_adapters))
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self._eos_token_ids = eos_ids

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(_Stop())
            await asyncio.to_thread(thread.join)
        await self.wait_for_kv_exports()

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._thread is None:
            raise EngineDeadError("engine not started")
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop thread is not running")

    def stats(self) -> EngineStats:
        num_waiting = self._scheduler.num_waiting + max(0, self._num_submitted - self._num_seen)
        capacity = self.max_num_seqs * self.max_model_len
        return EngineStats(
            num_running=self._scheduler.num_running,
            num_waiting=num_waiting,
            kv_usage=min(1.0, self._num_cached_tokens / capacity),
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated_tokens,
        )

    def prefill_tokens_per_s(self) -> Optional[float]:
        """Measured marginal prefill speed (prompt tokens per second a prefill adds, its
        fixed cost left out: ``PrefillTimeModel``), None until a prefill has run or when
        the tokens measured cost nothing beyond the fixed part."""
        per_token = self._prefill_time.per_token_seconds
        return None if not per_token else 1.0 / per_token

    def prefill_fixed_seconds(self) -> Optional[float]:
        """Measured fixed cost of a prefill (a forward pass of no tokens), None until one ran."""
        return self._prefill_time.fixed_seconds

    def kv_stats(self) -> KVStats:
        """Snapshot of the KV-reuse counters."""
        s = self._kv_stats
        return KVStats(
            lookups=s.lookups,
            prefix_hit_tokens=s.prefix_hit_tokens,
            blocks_imported=s.blocks_imported,
            prefilled_tokens=s.prefilled_tokens,
            fetch_skipped=s.fetch_skipped,
            import_rate_resets=s.import_rate_resets,
            lookups_skipped=s.lookups_skipped,
            fetch_failures=s.fetch_failures,
            blocks_exported=s.blocks_exported,
            export_failures=s.export_failures,
            l1_hit_tokens=s.l1_hit_tokens,
            l1_dropped_blocks=s.l1_dropped_blocks,
            **self._arena_stats(),
            prefill_tokens_per_s=self.prefill_tokens_per_s(),
            prefill_fixed_seconds=self.prefill_fixed_seconds(),
            import_bytes_per_s={
                tier: rate for tier in self._import_rate if (rate := self.import_bytes_per_s(tier)) is not None
            },
        )

    @staticmethod
    def _arena_stats() -> dict:
        """This process's KV arena (shared by its engines), zeros while it has none."""
        arena = kv_arena.current()
        if arena is None:
            return {}
        stats = arena.stats()
        return {
            "arena_fallbacks": stats["fallbacks"],
            "arena_used_bytes": stats["used_bytes"],
            "arena_capacity_bytes": stats["capacity_bytes"],
        }

    def drop_cached_blocks(self, hashes: list[str]) -> int:
        """Drop these KV blocks (a deleted session's) from L1; how many it held. A request
        still running with them keeps its own copy, and one of that session's turns that
        was under way as it was deleted may put its blocks back when it ends."""
        if self._l1 is None:
            return 0
        n = self._l1.discard(hashes)
        self._kv_stats.l1_dropped_blocks += n
        return n

    def num_pending_kv_exports(self) -> int:
        """Exports scheduled and not yet handed to ``connector.save``."""
        return len(self._export_tasks)

    async def wait_for_kv_exports(self) -> None:
        """Wait until every export scheduled so far has been handed to ``connector.save``
        (exports run in the background after a request's last delta)."""
        # Waits on the unfinished ones only. A finished task stays in the set until its
        # done callback runs, on a later turn of the event loop; and on Python >= 3.12
        # ``gather`` of finished tasks completes without yielding to the loop, so
        # ``while self._export_tasks: await gather(...)`` spun forever on one (a
        # shutdown hung on the H200 machine's Python 3.12, loadtests/gpu_check.sh).
        while pending := [t for t in self._export_tasks if not t.done()]:
            await asyncio.wait(pending)

    # ------------------------------------------------------------------ asyncio side

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(
            request,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            active_ids=self._active,
        )
        if request.lora is not None and request.lora not in self._lora_slots:
            raise RequestRejected(f"no LoRA adapter {request.lora!r} here", param="model")

    def _lora_rows(self, reqs: list[_Request]) -> dict:
        """The model call's ``lora_rows`` for a batch of ``reqs`` (none without adapters)."""
        if not self._lora_slots:
            return {}
        return {"lora_rows": [self._lora_slots.get(r.request.lora, 0) for r in reqs]}

    def _decode(self, token_ids: list[int]) -> str:
        return self._loop_tokenizer.decode(token_ids, skip_special_tokens=True)

    def _decode_all(self, token_ids: list[int]) -> str:
        """The text of special tokens too (SamplingParams.skip_special_tokens off)."""
        return self._loop_tokenizer.decode(token_ids, skip_special_tokens=False)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """A request's bad_words as token sequences (RequestRejected: 400)."""
        try:
            return bad_words_token_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False), words)
        except ValueError as e:
            raise RequestRejected(str(e), param="bad_words") from None

    async def _constraint(self, params) -> Constraint:
        """The compiled grammar of a request's structured output (RequestRejected: 400)."""
        kind, spec = params.structured_output
        async with self._grammar_lock:
            # One at a time: two first requests made two in parallel threads, and
            # transformers' lazy import is not safe from two threads at once (an
            # ImportError of AutoTokenizer in one of them, seen in loadtests/sampling_overhead).
            if self._grammar is None:
                self._grammar = await asyncio.to_thread(
                    GrammarCompiler.for_checkpoint, self.model_path, self.config.vocab_size
                )
        started = time.perf_counter()
        try:
            compiled = await asyncio.wait_for(
                asyncio.to_thread(self._grammar.compile, kind, spec), GRAMMAR_COMPILE_TIMEOUT_S
            )
        except (ValueError, asyncio.TimeoutError) as e:
            # A grammar past the bound (a pathological pattern) is refused as vLLM refuses
            # one; its thread runs on to the end, which nothing can cut short.
            reason = str(e) or f"the {kind} constraint took over {GRAMMAR_COMPILE_TIMEOUT_S:.0f} s to compile"
            logger.info("structured output refused: %s", reason)
            raise RequestRejected(reason, param="response_format") from None
        took = time.perf_counter() - started
        if took > 0.1:  # repeats come from xgrammar's cache
            logger.info("compiled a %s grammar in %.0f ms", kind, 1000 * took)
        return self._grammar.constraint(compiled)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self._validate(request)
        params = request.sampling
        constraint = await self._constraint(params) if params.structured_output else None
        bad_words = self._bad_words(params.bad_words) if params.bad_words else []
        loop = asyncio.get_running_loop()
        req = _Request(
            seq=Sequence(request.request_id, list(request.prompt_token_ids), params.max_tokens,
                         priority=request.priority),
            request=request,
            detokenizer=IncrementalDetokenizer(
                self._decode if params.skip_special_tokens else self._decode_all, params.stop, params.min_tokens,
                include_stop=params.include_stop_str_in_output,
            ),
            generator=make_generator(params.seed) if params.temperature > 0 else None,
            loop=loop,
            results=asyncio.Queue(),
            ended=loop.create_future(),
            constraint=constraint,
            bad_words=bad_words,
        )
        self._check_alive()
        # Claimed before the (awaiting) prefix fetch, so a duplicate id is still refused.
        self._active[request.request_id] = req.ended
        submitted = finished = False
        try:
            if self._kv is not None and params.prompt_logprobs is None:
                # Prompt logprobs need every prompt position's logits: no cached prefix.
                req.prefix = await self._fetch_prefix(request)
            with self._lifecycle_lock:
                self._check_alive()
                self._num_submitted += 1
                self._inbox.put(_Add(req))
                submitted = True
            while True:
                items = [await req.results.get()]
                while not req.results.empty():
                    items.append(req.results.get_nowait())
                delta = _coalesce(items)  # raises the engine's error, if one came
                if delta.finish_reason is not None:
                    finished = True
                yield delta
                if finished:
                    return
        except (EngineError, RequestRejected):
            finished = True  # the engine already dropped it (or never took it)
            raise
        finally:
            self._active.pop(request.request_id, None)
            if submitted and not finished:
                # aclose() or cancellation: free the slot at the next step.
                self._inbox.put(_Abort(request.request_id))

    def end_signal(self, request_id: str) -> Optional[asyncio.Future]:
        return self._active.get(request_id)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine is not running")

    async def _fetch_prefix(self, request: GenerationRequest) -> Optional[torch.Tensor]:
        """The stored K/V of the longest cached prefix of the prompt, as one
        ``[layers, 2, kv_heads, P, head_dim]`` tensor already on the engine's device, or
        None (miss, skipped, failed).

        Fetch or recompute: a stored prefix is used only when importing it (load from its
        tier, decode, copy to the device) is measured to be faster than prefilling its
        tokens. On a CPU the import is a fraction of a prefill; on an accelerator a small
        model prefills thousands of tokens in the time the host-to-device copy alone takes
        (measured on an H200: ``loadtests/engine_kv.py``), so the same cached prefix is
        worth fetching on one machine and not on the other. L1 is a tier like the others
        here: its import is a host copy plus the copy to the device."""
        kv, stats, tenant = self._kv, self._kv_stats, request.tenant
        hashes = prompt_lookup_hashes(self.model_id, request, self.block_size)
        if not hashes:
            return None
        stats.lookups += 1
        l1_blocks = self._l1.longest_prefix(hashes) if self._l1 is not None else 0
        # The tokens the request's cache will hold soon: the prefix arrives in a buffer
        # with room for the prompt's suffix and the first output tokens, so the prefill
        # appends there instead of copying the prefix again (kv_buffer.py).
        capacity = len(request.prompt_token_ids) + min(request.sampling.max_tokens, DECODE_ROOM_TOKENS)
        t0 = time.perf_counter()
        try:
            # The data plane may hold more than L1 (a turn served by another replica).
            hit = PrefixHit(0)
            if l1_blocks < len(hashes) and request.kv_lookup_skip:
                stats.lookups_skipped += 1
            elif l1_blocks < len(hashes):
                hit = await kv.lookup(tenant, hashes, started=_started_lookup(request, hashes))
            t_lookup = time.perf_counter() - t0
            num_blocks = min(int(hit.num_blocks), len(hashes))
            if l1_blocks >= num_blocks:
                return await self._l1_prefix(hashes, l1_blocks, capacity)
            if num_blocks != hit.num_blocks:
                hit = PrefixHit(num_blocks, hit.tier, hit.num_bytes * num_blocks // max(1, hit.num_blocks))
            if not self._worth_importing(hit.tier, num_blocks, hit.num_bytes, kv.bandwidth_bytes_per_s(hit.tier)):
                return await self._l1_prefix(hashes, l1_blocks, capacity)  # what L1 holds of it, if any
            started = time.perf_counter()
            blocks = await kv.load(tenant, hashes[:num_blocks])
            elapsed = time.perf_counter() - started
            if blocks is None or len(blocks) != num_blocks:
                stats.fetch_failures += 1
                logger.info("kv prefix load of %d blocks missed for %s", num_blocks, request.request_id)
                return await self._l1_prefix(hashes, l1_blocks, capacity)
            num_bytes = sum(len(b) for b in blocks)
            if elapsed > 0:
                kv.record_fetch(hit.tier, num_bytes, elapsed)
            t_decode = time.perf_counter()
            if num_bytes > _DECODE_INLINE_MAX_BYTES or self._l1 is not None or self.device.type != "cpu":
                prefix, faults = await asyncio.to_thread(self._decode_counted, blocks, hashes[:num_blocks], capacity)
            else:
                prefix, faults = self._decode_counted(blocks, None, capacity)
            self._record_import(hit.tier, num_bytes, time.perf_counter() - started)
            logger.debug(
                "kv prefix fetched: request=%s tier=%s blocks=%d bytes=%d lookup_ms=%.1f load_ms=%.1f "
                "decode_ms=%.1f decode_faults=%d",
                request.request_id, hit.tier, num_blocks, num_bytes, 1000 * t_lookup, 1000 * elapsed,
                1000 * (time.perf_counter() - t_decode), faults,
            )
            return prefix
        except CorruptBlockError as e:
            stats.fetch_failures += 1
            logger.warning("corrupt kv block for %s, recomputing: %s", request.request_id, e)
        except Exception:  # noqa: BLE001 - a store failure is a miss, never a failed request
            stats.fetch_failures += 1
            logger.warning("kv prefix fetch failed for %s, recomputing", request.request_id, exc_info=True)
        return None

    def _worth_importing(
        self, tier: str, num_blocks: int, num_bytes: int, transport_bytes_per_s: Optional[float] = None
    ) -> bool:
        """Whether to import ``num_blocks`` stored blocks from ``tier`` rather than prefill
        them: :func:`should_fetch` with this engine's measured import rate of the tier
        (load, decode and copy to the device; before the first import, the store's
        transport figure). Recomputing is not forever: after ``_EXPLORE_EVERY_SKIPS``
        skips in a row it imports anyway to re-measure, since only an import can update the
        figure; sooner while the figure rests on fewer imports than that (after one import,
        after one skip). An import far faster than the figure replaces it (``Rate``), so one
        stalled import costs a skip or two, not a run of them."""
        if self.always_fetch:
            return True
        rate = self._import_rate.get(tier)
        fetch = should_fetch(
            PrefixHit(num_blocks, tier, num_bytes),
            bandwidth_bytes_per_s=(rate.value if rate is not None else None) or transport_bytes_per_s,
            recompute_seconds=self._prefill_time.marginal_seconds(num_blocks * self.block_size),
        )
        skips = self._skips_since_fetch.get(tier, 0)
        # A figure from few imports is checked again sooner: after one import, one skip.
        explore_after = min(_EXPLORE_EVERY_SKIPS, rate.samples) if rate is not None else _EXPLORE_EVERY_SKIPS
        if not fetch and skips < explore_after:
            self._skips_since_fetch[tier] = skips + 1
            self._kv_stats.fetch_skipped += 1
            return False
        self._skips_since_fetch[tier] = 0
        return True

    def _record_import(self, tier: str, num_bytes: int, seconds: float) -> None:
        rate = self._import_rate.setdefault(tier, Rate())
        figure, resets = rate.value, rate.resets
        rate.update(num_bytes, seconds)
        if rate.resets != resets:
            self._kv_stats.import_rate_resets += 1
            # DEBUG, not INFO: under load a tier's samples vary 10-100x, and a worker of
            # the autoscaling test restarted its L1 figure 8 times in 8 s (the counter
            # is what to watch).
            logger.debug(
                "kv import figure of %s restarted from an import over %gx faster than it: %.3f GB/s "
                "against %.3f GB/s (a stalled import, or smaller ones, had set it)",
                tier, rate.reset_factor, num_bytes / seconds / 1e9, figure / 1e9,
            )

    def import_bytes_per_s(self, tier: str) -> Optional[float]:
        """Measured speed of importing a prefix from ``tier`` (load + decode + copy to the
        device, bytes of stored blocks per second), None until one was imported."""
        rate = self._import_rate.get(tier)
        return None if rate is None else rate.value

    def _decode_counted(
        self, blocks: list[bytes], hashes: Optional[list[str]], capacity: int
    ) -> tuple[torch.Tensor, int]:
        """:meth:`_decode_prefix` and the minor page faults it took in this thread (its
        buffer's fresh pages: what a decode's time mostly depends on here)."""
        before = minor_faults()
        prefix = self._decode_prefix(blocks, hashes, capacity)
        return prefix, minor_faults() - before

    def _decode_prefix(
        self, blocks: list[bytes], hashes: Optional[list[str]] = None, capacity: int = 0
    ) -> torch.Tensor:
        """The blocks as one span on the engine's device, leading a buffer that holds
        ``capacity`` tokens (one copy of each block on a CPU; on an accelerator, a second
        copy from the host, as before)."""
        shape = list(self._kv_block_shape)
        shape[3] *= len(blocks)
        out = empty_with_room(shape, capacity - shape[3], dtype=self.dtype) if self.device.type == "cpu" else None
        prefix = decode_kv_blocks(
            blocks, dtype=self.dtype, shape=self._kv_block_shape, verify=not isinstance(blocks, CheckedBlocks), out=out
        )
        if self._l1 is not None and hashes:
            self._l1.put(hashes, prefix)  # a fetched prefix is local from now on (on the host)
        return with_room(prefix, capacity - shape[3], self.device)

    async def _l1_prefix(self, hashes: list[str], num_blocks: int, capacity: int = 0) -> Optional[torch.Tensor]:
        """What L1 holds of the prefix (its first ``num_blocks`` blocks), when importing it
        is measured to beat prefilling it (the same decision as for the store's tiers)."""
        if num_blocks <= 0 or self._l1 is None:
            return None
        if not self._worth_importing(TIER_L1, num_blocks, num_blocks * self._l1_block_bytes()):
            return None
        return await self._from_l1(hashes, num_blocks, capacity)

    async def _from_l1(self, hashes: list[str], num_blocks: int, capacity: int = 0) -> Optional[torch.Tensor]:
        """The first ``num_blocks`` blocks from L1 as one prefix tensor on the engine's
        device; None if there are none (or one was evicted since the lookup)."""
        if num_blocks <= 0 or self._l1 is None:
            return None
        started = time.perf_counter()
        if num_blocks * self._l1_block_bytes() > _DECODE_INLINE_MAX_BYTES or self.device.type != "cpu":
            prefix = await asyncio.to_thread(self._l1_get, hashes[:num_blocks], capacity)
        else:
            prefix = self._l1_get(hashes[:num_blocks], capacity)
        if prefix is not None:
            self._kv_stats.l1_hit_tokens += num_blocks * self.block_size
            self._record_import(TIER_L1, num_blocks * self._l1_block_bytes(), time.perf_counter() - started)
        return prefix

    def _l1_get(self, hashes: list[str], capacity: int = 0) -> Optional[torch.Tensor]:
        room = capacity - len(hashes) * self.block_size
        prefix = self._l1.get(hashes, room if self.device.type == "cpu" else 0)  # L1 is on the host
        return None if prefix is None else with_room(prefix, room, self.device)

    def _kv_token_bytes(self) -> int:
        """Bytes of one token's K/V over all layers."""
        return self._l1_block_bytes() // self.block_size

    def _l1_block_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self._kv_block_shape:
            n *= d
        return n

    def prefix_cache_keys(self) -> bytes:
        """Keys of the blocks in L1 (8 bytes of each hash), for cache-aware placement."""
        return self._l1.packed_keys() if self._l1 is not None else b""

    def _start_export(self, export: Callable[[], Awaitable[None]]) -> None:
        """On the request's event loop: run ``export`` (an :meth:`_export` call) as a task."""
        task = asyncio.get_running_loop().create_task(export())
        self._export_tasks.add(task)
        task.add_done_callback(self._export_tasks.discard)

    async def _export(
        self,
        tenant: str,
        token_ids: list[int],
        first_block: int,
        span: torch.Tensor,
        session_id: Optional[str] = None,
        salt: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> None:
        """Encode and save one finished request's new blocks (listed under its session or
        stored response, ``GenerationRequest.blocks_owner``, if it has one, so deleting
        that erases them)."""
        try:
            root, hashes, blocks = await asyncio.to_thread(
                self._encode_export, tenant, token_ids, first_block, span, salt, lora
            )
            self._kv.save(tenant, hashes, blocks, session_id, chain_root=root)
            self._kv_stats.blocks_exported += len(blocks)
        except Exception:  # noqa: BLE001 - never surfaces to a request
            self._kv_stats.export_failures += 1
            logger.warning("kv export failed", exc_info=True)

    def _encode_export(
        self,
        tenant: str,
        token_ids: list[int],
        first_block: int,
        span: torch.Tensor,
        salt: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> tuple[Optional[str], list[str], list[bytes]]:
        """The chain's first hash, and the hashes and stored bytes of its blocks from
        ``first_block`` on (those ``span`` holds)."""
        chain = block_hashes(self.model_id, tenant, token_ids, self.block_size, salt, lora)
        hashes = chain[first_block:]
        blocks = encode_kv_blocks(span, self.block_size)
        if len(hashes) != len(blocks):
            raise RuntimeError(f"{len(hashes)} hashes for {len(blocks)} exported blocks")
        if self._l1 is not None:
            self._l1.put(hashes, span)
        return (chain[0] if chain else None), hashes, blocks

    # ------------------------------------------------------------------ loop thread

    def _run_loop(self, warmed: concurrent.futures.Future) -> None:
        if self.cpu_nice and self.device.type == "cpu":
            # Before the first forward pass: OpenMP's threads are made by the thread that
            # first needs them, and take its priority.
            nice = lower_thread_priority(self.cpu_nice)
            if nice is not None:
                logger.info(
                    "torch engine: its threads run at nice %d (cpu_nice %d): on a CPU the HTTP "
                    "front, router and data plane go before decode steps",
                    nice,
                    self.cpu_nice,
                )
        if self.num_threads is not None:
            # Set here, not in start(): OpenMP's thread count is per calling thread.
            torch.set_num_threads(self.num_threads)
        try:
            with torch.inference_mode():
                self._warm_kernels()
                warmed.set_result(None)
                while True:
                    if not self._drain_inbox(block=not self._scheduler.has_work()):
                        break
                    if self._scheduler.has_work():
                        self._step()
            error: BaseException = EngineDeadError("engine shut down")
        except BaseException as e:  # noqa: BLE001 - any failure must reach the requests
            logger.exception("torch engine loop failed")
            error = e
            self._dead = e
        if not warmed.done():
            warmed.set_exception(error)
        with self._lifecycle_lock:
            if self._dead is None:
                self._dead = error
            leftovers = [cmd.req for cmd in self._drain_all() if isinstance(cmd, _Add)]
        exc = error if isinstance(error, EngineError) else EngineError(f"engine step failed: {error!r}")
        for req in list(self._reqs_by_id.values()) + leftovers:
            self._deliver(req, exc)
        self._scheduler.abort_all()
        self._reqs_by_id.clear()
        self._batch = _Batch()
        self._num_cached_tokens = 0

    def _warm_kernels(self) -> None:
        """A throwaway prefill and decode step on the loop thread before the first request:
        a fresh process's first forward pass pays one-time costs (OpenMP threads, oneDNN
        primitives, the allocator's first growth; on the small model a 32-token prefill took
        64 ms cold and 16 ms warm). The first request should not pay them, and the prefill
        time model (``_account_prefill``) must not learn them: one slow short prefill makes
        its least-squares fit 0 s per token (see ``forget_measurements``).

        Then, with ``warmup_prefill_tokens`` (off by default), one prefill that long. A
        prefill longer than any before it grows the allocator's memory (malloc's heap on a
        CPU, kept once grown with ``serve_runtime.keep_freed_memory``; CUDA's caching
        allocator), and on a CPU every new page faults on first write (3-140 µs each on
        the VMs here): on the small model 4-9k faults for each longer prompt in one
        process, none for a prompt no longer than one before. In a replica a 2048-token
        warm-up cut a growing conversation's prefill faults to a third or a half, not to
        none (what runs between prefills fragments the heap), at 2-2.8 s of start
        (loadtests/README.md, "A long warm-up prefill"). vLLM's engine runs a profiling
        forward pass at start for a like reason."""
        self._warm_prefill(WARM_UP_TOKENS, decode=True)
        if self.warmup_prefill_tokens:
            faults, started = process_minor_faults(), time.perf_counter()
            self._warm_prefill(self.warmup_prefill_tokens, decode=False)
            logger.info(
                "torch engine: warm-up prefill of %d tokens in %.0f ms (%d page faults in "
                "the process meanwhile): the allocator's memory grew for it at start",
                self.warmup_prefill_tokens,
                1000 * (time.perf_counter() - started),
                process_minor_faults() - faults,
            )

    def _warm_prefill(self, n: int, *, decode: bool) -> None:
        ids = (torch.arange(n, device=self.device) % self.config.vocab_size).unsqueeze(0)
        cache = growable_cache(self._kv_block_shape[0], hf=self._hf_cache)
        logits = self.model(
            input_ids=ids,
            attention_mask=torch.ones((1, n), dtype=torch.long, device=self.device),
            position_ids=torch.arange(n, device=self.device).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if not decode:
            logits.float().cpu()  # waits for the device
            return
        self.model(
            input_ids=logits.argmax(-1, keepdim=True),
            attention_mask=torch.ones((1, n + 1), dtype=torch.long, device=self.device),
            position_ids=torch.tensor([[n]], device=self.device),
            past_key_values=cache,
            use_cache=True,
        ).logits.float().cpu()

    def forget_measurements(self) -> None:
        """Drop the measured prefill and import speeds that the fetch-or-recompute decision
        weighs, and the KV store's transport figures (counters stay). The worker calls it
        after its warm-up generation, which runs while the other replicas of the
        application start on the same cores: a 32-token warm-up prefill measured 0.84 s
        there, against ~35 ms for 100 tokens a moment later, and with that sample the
        fitted per-token cost was 0, so the first turns of sessions recomputed their
        stored prefixes. The warm-up's prompt is the same on every replica, so from the
        second replica a deployment ever started on, it is found in Redis: its one-block
        read on fresh connections (a 98.5 ms lookup, 10.9 ms to read 262 KB) left an L3
        transport figure of 24 MB/s, and the first four L3 hits of sessions were
        recomputed (``loadtests.multiturn``, 2026-12-03: turns 2-5 at 130-420 ms
        instead of ~100)."""
        self._prefill_time = PrefillTimeModel()
        self._import_rate.clear()
        self._skips_since_fetch.clear()
        if self._kv is not None:
            self._kv.forget_bandwidth()

    def _drain_all(self) -> list[_Command]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        commands = [self._inbox.get()] if block else []
        commands += self._drain_all()
        keep_running = True
        for cmd in commands:
            if isinstance(cmd, _Stop):
                # Keep applying the rest, so adds queued behind the stop get failed too.
                keep_running = False
            elif isinstance(cmd, _Add):
                self._num_seen += 1
                try:
                    self._scheduler.add(cmd.req.seq)
                except ValueError as e:
                    self._deliver(cmd.req, RequestRejected(str(e)))
                    continue
                self._reqs_by_id[cmd.req.seq.request_id] = cmd.req
            elif isinstance(cmd, _Abort):
                req = self._reqs_by_id.pop(cmd.request_id, None)
                if req is not None:
                    req.done = True
                    self._scheduler.abort(cmd.request_id)
        self._drop_done_rows()
        return keep_running

    def _step(self) -> None:
        out = self._scheduler.schedule()
        new_reqs = [self._reqs_by_id[s.request_id] for s in out.prefill]
        old_reqs = list(self._batch.reqs)
        # Every running sequence gets exactly one token per step: the new ones from their
        # prefill, the others from one batched decode. New ones with an imported prefix are
        # prefilled one at a time on their own pre-filled cache; the rest as one batch.
        for r in new_reqs:
            if r.prefix is not None and not 0 < r.prefix.shape[3] < len(r.seq.prompt_token_ids):
                # generate() never builds such a prefix; recompute rather than kill the loop.
                logger.error("dropping an imported prefix of %d tokens for a %d-token prompt",
                             r.prefix.shape[3], len(r.seq.prompt_token_ids))
                r.prefix = None
        plain = [r for r in new_reqs if r.prefix is None and r.request.sampling.prompt_logprobs is None]
        parts = [self._prefill(plain)] if plain else []
        # A request that asked for its prompt's logprobs keeps every position's logits: on
        # its own, so that no other row pays for (or pads) a [width, vocab] block.
        parts += [
            self._prefill([r], all_logits=True)
            for r in new_reqs if r.prefix is None and r.request.sampling.prompt_logprobs is not None
        ]
        parts += [self._prefill_with_prefix(r) for r in new_reqs if r.prefix is not None]
        if old_reqs:
            self._decode_step()
        for part in parts:
            self._merge(part)
        self._num_steps += 1
        for req in new_reqs + old_reqs:
            self._postprocess(req)
        self._drop_done_rows()

    def _prefill(self, reqs: list[_Request], all_logits: bool = False) -> _Batch:
        """Prefill ``reqs`` as one left-padded batch; ``all_logits`` (one request): keep
        every position's logits and turn them into its prompt logprobs."""
        lengths = [len(r.seq.prompt_token_ids) for r in reqs]
        width = max(lengths)
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        input_ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            input_ids[i, width - lengths[i] :] = torch.tensor(r.seq.prompt_token_ids)
            mask[i, width - lengths[i] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = growable_cache(self._kv_block_shape[0], hf=self._hf_cache)
        faults = _faults_if_debug()
        started = time.perf_counter()
        logits = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **self._lora_rows(reqs),
        ).logits
        if all_logits:
            (req,) = reqs
            prompt = req.seq.prompt_token_ids
            req.prompt_logprobs = [None] + prompt_logprobs(
                logits[0, :-1], prompt[1:], req.request.sampling.prompt_logprobs
            )
        logits = logits[:, -1]
        self._sample_into(reqs, logits, "prefill")  # syncs (logits go to the CPU)
        self._account_prefill(reqs, width, sum(lengths), 0, started, faults)
        return _Batch(reqs=list(reqs), cache=cache, mask=mask.to(self.device))

    def _prefill_with_prefix(self, req: _Request) -> _Batch:
        """Prefill one request whose first P prompt tokens' K/V were imported: the cache
        starts with them and only prompt[P:] is fed, at positions P.."""
        span, req.prefix = req.prefix, None
        prompt = req.seq.prompt_token_ids
        num_prefix, num_prompt = span.shape[3], len(prompt)  # 0 < P < prompt, checked in _step
        # The layers hold views of the span and append the suffix into the room of the
        # buffer it leads (_fetch_prefix made it with room); without room, the first
        # update copies it into a new buffer once (kv_buffer.py).
        cache = growable_cache(self._kv_block_shape[0], span.to(self.device), hf=self._hf_cache)
        del span
        input_ids = torch.tensor([prompt[num_prefix:]], dtype=torch.long, device=self.device)
        mask = torch.ones((1, num_prompt), dtype=torch.long, device=self.device)
        positions = torch.arange(num_prefix, num_prompt, device=self.device).unsqueeze(0)
        faults = _faults_if_debug()
        started = time.perf_counter()
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **self._lora_rows([req]),
        ).logits[:, -1]
        self._sample_into([req], logits, "prefill")
        req.num_imported_tokens = num_prefix
        self._account_prefill([req], num_prompt - num_prefix, num_prompt - num_prefix, num_prefix, started, faults)
        return _Batch(reqs=[req], cache=cache, mask=mask)

    def _account_prefill(
        self, reqs: list[_Request], width: int, computed: int, imported: int, started: float, faults: Optional[int]
    ) -> None:
        """Count a prefill that began at ``started`` and feed its time to the prefill time
        model; at DEBUG (``faults``: :func:`_faults_if_debug` at its start) log its time
        and the page faults the process took meanwhile (mostly the forward pass's)."""
        seconds = time.perf_counter() - started
        if faults is not None:
            logger.debug(
                "prefill: requests=%s rows=%d width=%d imported=%d ms=%.1f faults=%d",
                ",".join(r.seq.request_id for r in reqs), len(reqs), width, imported, 1000 * seconds,
                process_minor_faults() - faults,
            )
        stats = self._kv_stats
        stats.prefilled_tokens += computed
        if imported:
            stats.prefix_hit_tokens += imported
            stats.blocks_imported += imported // self.block_size
        self._prefill_time.add(computed, seconds)

    def _decode_step(self) -> None:
        batch = self._batch
        input_ids = torch.tensor([[r.pending_token_id] for r in batch.reqs], device=self.device)
        # Position of the fed token = tokens of this sequence already in the cache.
        positions = torch.tensor([[r.seq.num_tokens - 1] for r in batch.reqs], device=self.device)
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.reqs), 1))], dim=1)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            **self._lora_rows(batch.reqs),
        ).logits[:, -1]
        batch.mask = mask
        self._sample_into(batch.reqs, logits, "decode")

    def _sample_into(self, reqs: list[_Request], logits: torch.Tensor, phase: str) -> None:
        logits = logits.float().cpu()
        hook = self.logits_hook
        if hook is not None:
            hook([r.seq.request_id for r in reqs], logits.clone(), phase)
        params = [r.request.sampling for r in reqs]
        raw = logits  # logprobs are of the model's own distribution
        rows = [i for i, (r, p) in enumerate(zip(reqs, params)) if adjusts_logits(p, len(r.seq.output_token_ids))]
        if rows:
            logits = raw.clone()
            logits[rows] = adjust_logits(
                raw[rows],
                [params[i] for i in rows],
                [reqs[i].seq.prompt_token_ids for i in rows],
                [reqs[i].seq.output_token_ids for i in rows],
                [set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else self._eos_token_ids) for i in rows],
            )
        for i, r in enumerate(reqs):
            if r.bad_words and (banned := banned_tokens(r.bad_words, r.seq.output_token_ids)):
                if logits is raw:
                    logits = raw.clone()
                logits[i, banned] = float("-inf")
            if r.constraint is not None:
                if logits is raw:
                    logits = raw.clone()
                r.constraint.mask(logits[i : i + 1])
        token_ids = sample(
            logits,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [r.generator for r in reqs],
            [p.top_k for p in params],
            [p.min_p for p in params],
        )
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            found = token_logprobs(
                raw, wanted, [token_ids[i] for i in wanted], [params[i].logprobs for i in wanted]
            )
            for i, entry in zip(wanted, found):
                reqs[i].pending_logprobs = entry
        for r, token_id in zip(reqs, token_ids):
            r.pending_token_id = token_id
            self._scheduler.append_token(r.seq, token_id)
            if r.constraint is not None and not r.constraint.accept(token_id):
                # Only when every token was masked (nothing the grammar allows was left).
                logger.warning("request %s: token %d is outside its grammar", r.seq.request_id, token_id)
        self._num_generated_tokens += len(reqs)

    def _merge(self, part: _Batch) -> None:
        """Append ``part``'s rows to the running batch, left-padding the shorter side."""
        batch = self._batch
        if not batch.reqs:
            self._batch = part
            self._update_cached_tokens()
            return
        width = max(batch.mask.shape[1], part.mask.shape[1])
        for dst, src in zip(batch.cache.layers, part.cache.layers):
            dst.keys = torch.cat([_left_pad(dst.keys, width, -2), _left_pad(src.keys, width, -2)], dim=0)
            dst.values = torch.cat([_left_pad(dst.values, width, -2), _left_pad(src.values, width, -2)], dim=0)
        batch.mask = torch.cat([_left_pad(batch.mask, width, -1), _left_pad(part.mask, width, -1)], dim=0)
        batch.reqs.extend(part.reqs)
        self._update_cached_tokens()

    def _drop_done_rows(self) -> None:
        """Remove finished/aborted rows and the padding columns no remaining row needs."""
        batch = self._batch
        keep = [i for i, r in enumerate(batch.reqs) if not r.done]
        if len(keep) == len(batch.reqs):
            return
        if not keep:
            self._batch = _Batch()
            self._update_cached_tokens()
            return
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0].item())
        batch.mask = mask[:, first:]
        for layer in batch.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]
        batch.reqs = [batch.reqs[i] for i in keep]
        self._update_cached_tokens()

    def _update_cached_tokens(self) -> None:
        mask = self._batch.mask
        self._num_cached_tokens = 0 if mask is None else int(mask.sum().item())

    def _postprocess(self, req: _Request) -> None:
        if req.done:  # aborted while its token was being computed
            return
        seq, params = req.seq, req.request.sampling
        token_id = seq.output_token_ids[-1]
        finish = None
        grammar_done = req.constraint is not None and req.constraint.terminated
        if (
            grammar_done
            or (not params.ignore_eos and token_id in self._eos_token_ids)
            or token_id in params.stop_token_ids
        ):
            # The token that ended the reply stays out of its text, as vLLM leaves it out
            # unless include_stop_str_in_output (a special token's text is none anyway,
            # with skip_special_tokens); a complete grammar ends on the end-of-sequence
            # token it accepted last.
            text = req.detokenizer.add_tokens([token_id]).text if params.include_stop_str_in_output else ""
            text, finish = text + req.detokenizer.flush(), "stop"
        else:
            out = req.detokenizer.add_tokens([token_id])
            text = out.text
            if out.stop is not None:
                finish = "stop"
            elif len(seq.output_token_ids) >= seq.max_tokens:
                text += req.detokenizer.flush()
                finish = "length"
        delta = TokenDelta(
            text=text,
            token_ids=[token_id],
            finish_reason=finish,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            logprobs=None if params.logprobs is None else [req.pending_logprobs],
            prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=req.num_imported_tokens,
        )
        req.prompt_logprobs = None  # the first delta's only
        if finish is not None:
            if self._kv is not None:
                # Before the last delta, so the export is under way when the caller sees it.
                self._export_blocks(req)
            req.done = True
            self._scheduler.finish(seq)
            self._reqs_by_id.pop(seq.request_id, None)
        if not self._deliver(req, delta) and not req.done:
            # Its event loop is gone: nobody will read the rest.
            req.done = True
            self._scheduler.abort(seq.request_id)
            self._reqs_by_id.pop(seq.request_id, None)

    def _export_blocks(self, req: _Request) -> None:
        """Copy the not-imported full blocks of a finished request's cached K/V out of the
        running batch (a cheap on-device copy) and hand them to its event loop, which
        encodes them off the loop thread and saves them."""
        try:
            seq, bs, batch = req.seq, self.block_size, self._batch
            # Every token but the last sampled one has been fed, so its K/V are cached.
            num_cached = seq.num_tokens - 1
            first_block, num_blocks = req.num_imported_tokens // bs, num_cached // bs
            if num_blocks <= first_block:
                return
            row = next(i for i, r in enumerate(batch.reqs) if r is req)
            width = batch.mask.shape[1]
            if int(batch.mask[row].sum()) != num_cached:
                raise RuntimeError(f"row holds {int(batch.mask[row].sum())} tokens, expected {num_cached}")
            # Rows are right-aligned: this row's tokens are the last num_cached columns.
            start = width - num_cached + first_block * bs
            end = width - num_cached + num_blocks * bs
            span = torch.stack(
                [
                    torch.stack((layer.keys[row, :, start:end], layer.values[row, :, start:end]))
                    for layer in batch.cache.layers
                ]
            )
            token_ids = (seq.prompt_token_ids + seq.output_token_ids)[: num_blocks * bs]
            export = functools.partial(
                self._export, req.request.tenant, token_ids, first_block, span, req.request.blocks_owner,
                req.request.cache_salt, req.request.lora,
            )
            req.loop.call_soon_threadsafe(self._start_export, export)
        except Exception:  # noqa: BLE001 - exporting is best effort
            self._kv_stats.export_failures += 1
            logger.warning("kv export of %s failed", req.seq.request_id, exc_info=True)

    def _deliver(self, req: Optional[_Request], item: Union[TokenDelta, BaseException]) -> bool:
        if req is None:
            return False
        try:
            req.loop.call_soon_threadsafe(req.hand_over, item)
            return True
        except RuntimeError:  # loop closed
            return False


def _faults_if_debug() -> Optional[int]:
    """The process's page faults so far when DEBUG is on (for a prefill's DEBUG line),
    else None without asking the kernel."""
    return process_minor_faults() if logger.isEnabledFor(logging.DEBUG) else None


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _started_lookup(request: GenerationRequest, hashes: list[str]):
    """The data-plane lookup the router started for this request (``kv_lookup``), if it
    looked up the prompt's own leading blocks: its key must be the hash of the last block
    it covered (all of the prompt's, or ``kv_lookup_blocks`` of them). Its hit then
    covers at most those blocks, which the connector's stash and ``load`` key by."""
    if request.kv_lookup is None:
        return None
    n = len(hashes) if request.kv_lookup_blocks is None else request.kv_lookup_blocks
    if not 0 < n <= len(hashes) or request.kv_lookup_key != hashes[n - 1]:
        return None
    return request.kv_lookup


def _coalesce(items: list[Union[TokenDelta, BaseException]]) -> TokenDelta:
    """Merge deltas that piled up while the consumer was busy into one."""
    for item in items:
        if isinstance(item, BaseException):
            raise item
    if len(items) == 1:
        return items[0]
    last = items[-1]
    return TokenDelta(
        text="".join(d.text for d in items),
        token_ids=[t for d in items for t in d.token_ids],
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        logprobs=None if last.logprobs is None else [e for d in items for e in d.logprobs or ()],
        prompt_logprobs=next((d.prompt_logprobs for d in items if d.prompt_logprobs is not None), None),
        num_cached_tokens=last.num_cached_tokens,
    )
