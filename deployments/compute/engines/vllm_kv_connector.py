"""vLLM KV connector (v1 interface) onto the data plane's L3: Redis, our keys, our blocks.

vLLM's own prefix cache is L1; this connector keeps the blocks it would lose. vLLM loads
it from ``KVTransferConfig(kv_connector="DataPlaneKVConnector",
kv_connector_module_path=__name__)`` and builds it twice: once in the EngineCore's
scheduler (role SCHEDULER) and once in each worker process (role WORKER). Neither process
is a Ray worker, so both talk to Redis directly with the synchronous client.

Contract
--------
* Block = ``B`` tokens, ``B`` = vLLM's KV block size (``cache_config.block_size``).
* Block name = ``kv.block_hashes(f"{model_id}|vllm", tenant, token_ids, B)``: the chained
  hash the torch engine uses, in a namespace of its own (vLLM's layout differs).
* Keys and write order = ``redis_store.put_blocks``: payload ``llm:<t>:kv:<h>`` first, then
  index ``llm:<t>:kvi:<h>`` (payload length), payload TTL = index TTL + 60 s; when the
  request names a session (or is a response to store: its id, ``blocks_owner``),
  ``<hash0>|<h>`` joins ``llm:<t>:sess:<id>:blocks`` so deleting the session (the
  response) deletes them. So the DataPlane's lookup/get/delete see these blocks too.
* Tenant, session and the request's ``cache_salt`` come per request in
  ``SamplingParams.extra_args["kv_transfer_params"]`` (``{"tenant": ..., "session_id":
  ..., "cache_salt": ...}``); tenant defaults to ``"default"``; the salt goes into the
  block names' hash chain as it does for the torch engine, and so does the LoRA adapter
  vLLM runs the request with (``request.lora_request``'s name).
* Scheduler: ``get_num_new_matched_tokens`` computes the prompt's block hashes (at most
  ``(len-1)//B`` blocks, so one token is always computed) and MGETs their index keys in one
  round trip; the run of present blocks after vLLM's local hit is what it offers to load.
  Each step, blocks that became full (prompt or generated tokens) and that Redis lacked
  are scheduled for saving.
* Worker: ``start_load_kv`` (before the forward, vLLM's synchronous-load path) MGETs the
  payloads, checks each (``blocks.decode_block``: magic, version, length, checksum) and its
  header against this engine's (dtype, shape, layout) and copies it into the paged cache;
  a failure marks that block and the request's later ones invalid
  (``get_block_ids_with_load_errors``) and vLLM, with ``kv_load_failure_policy=
  "recompute"``, recomputes them: a miss, never wrong output. ``wait_for_save`` (after the
  forward) copies the blocks out and writes them in one pipeline.
* Any Redis error is a miss (or a skipped save) plus one log line; after one, Redis is not
  tried again for ``retry_interval_s`` (no timeout per step during an outage).

Block layout
------------
See ``vllm_kv_blocks.py``: every backend hands the connector per-layer views of logical
shape ``[num_blocks, heads, B, content]``; a stored block is one block's interior in every
layer of the worker, stacked in layer order, in logical order, moved through host memory
(on a GPU: copies off the device per save and onto it per load, in chunks of at most
``vllm_kv_blocks.STAGING_BYTES`` of device memory). Its header's layout
names the device kind and the cache dtype setting, because the same shape means other
things on other backends (the CPU backend's, ``"vllm-cpu:layers,heads,kv,tokens,head_dim"``:
``[layers, heads, 2 (k, v), B, head_dim]``). With tensor or pipeline parallelism each
worker stores its own part of a block under ``<hash>@tp<r>of<n>.pp<r>of<n>``; the scheduler
asks for rank 0's part, and a worker whose part is missing reports a load error, which
vLLM recomputes (and drops rank 0's index entry, so the block is saved again whole). A per-layer view of another shape turns the connector off (every lookup
a miss), said once in the log.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

try:  # vLLM's guard against GPU↔CPU syncs in the step (a debug mode): ours are deliberate
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
except ImportError:  # pragma: no cover - other vLLM versions
    from contextlib import nullcontext as gpu_sync_allowed

from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.vllm_kv_blocks import (
    CPU_LAYOUT,
    block_bytes,
    block_layout,
    gather_blocks,
    rank_suffix,
    scatter_blocks,
)
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, CorruptBlockError, decode_block, encode_block

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so the lines reach vLLM's handlers in the EngineCore and worker processes.
logger = init_logger("vllm.dataplane_kv_connector")

__all__ = ["CPU_LAYOUT", "DataPlaneKVConnector"]
PAYLOAD_TTL_MARGIN_S = 60  # as redis_store: the index expires before its payload


@dataclass
class Transfer:
    """Blocks of one request to load or save: ``hashes[i]`` lives in ``block_ids[i]``."""

    req_id: str
    tenant: str
    hashes: list[str]
    block_ids: list[int]
    session_id: Optional[str] = None
    chain_head: str = ""  # the request's first block hash (the session member's shard key)


@dataclass
class DataPlaneConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _lora(request: "Request") -> Optional[str]:
    """The LoRA adapter vLLM runs ``request`` with (its name), or None: its KV is the
    adapter's own, so the name is in the block hashes (``kv.block_hashes``)."""
    lora_request = getattr(request, "lora_request", None)
    return lora_request.lora_name if lora_request is not None else None


@dataclass
class _ReqState:
    request: "Request"
    tenant: str
    session_id: Optional[str]
    present: list[bool]  # per leading block: already in Redis (from the lookup)
    next_block: int = 0  # blocks below this one are saved or known present
    salt: Optional[str] = None  # the request's cache_salt (in its block hashes)


class _Redis:
    """A lazily built synchronous client that backs off after a failure. ``prefix``
    picks the server in the extra config: ``redis_`` the durable one (sessions),
    ``kv_redis_`` the KV blocks' one (``dataplane.kv_redis``, absent: the same)."""

    def __init__(self, extra: dict[str, Any], prefix: str = "redis_"):
        if not extra.get(f"{prefix}url"):
            prefix = "redis_"
        self._url = str(extra.get(f"{prefix}url") or "redis://127.0.0.1:6379/0")
        env = extra.get(f"{prefix}password_env")
        self._password = (os.environ.get(env) if env else None) or None
        self._tls = dict(extra.get(f"{prefix}tls") or {})
        self._socket_timeout = float(extra.get("socket_timeout_s", 2.0))
        self._connect_timeout = float(extra.get("connect_timeout_s", 1.0))
        self.retry_interval_s = float(extra.get("retry_interval_s", 1.0))
        self._client = None
        self._down_until = 0.0

    @property
    def url(self) -> str:
        return self._url

    def client(self):
        """The client, or None while backing off after a failure."""
        if time.monotonic() < self._down_until:
            return None
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(
                self._url,
                **self._tls,
                password=self._password,
                socket_timeout=self._socket_timeout,
                socket_connect_timeout=self._connect_timeout,
            )
        return self._client

    def failed(self, what: str, exc: BaseException) -> None:
        logger.warning(
            "KV connector: Redis %s failed (%s: %s); treated as a miss, retrying in %.1fs",
            what, type(exc).__name__, exc, self.retry_interval_s,
        )
        self._down_until = time.monotonic() + self.retry_interval_s
        if self._client is not None:
            try:
                self._client.connection_pool.disconnect()
            except Exception:  # noqa: BLE001
                pass


class DataPlaneKVConnector(KVConnectorBase_V1):
    """Saves vLLM's KV blocks to the data plane's Redis and loads them back (see module)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._block_size = int(vllm_config.cache_config.block_size)
        wanted = extra.get("block_size")
        if wanted is not None and int(wanted) != self._block_size:
            logger.warning(
                "KV connector: vLLM's block size is %d, not the configured %s; blocks are %d tokens",
                self._block_size, wanted, self._block_size,
            )
        self._model_ns = f"{extra.get('model_id') or vllm_config.model_config.model}|vllm"
        parallel = vllm_config.parallel_config
        self._tp_size = int(parallel.tensor_parallel_size)
        self._pp_size = int(parallel.pipeline_parallel_size)
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        # The key suffix of rank 0's part of a block (what the scheduler looks up) and of
        # this worker's own part (set in register_kv_caches).
        self._lookup_suffix = rank_suffix(0, self._tp_size, 0, self._pp_size)
        self._suffix = self._lookup_suffix
        self._kv_ttl_s = int(extra.get("kv_ttl_s", 86_400))
        self._session_ttl_s = int(extra.get("session_ttl_s", 1800))
        self._redis = _Redis(extra)  # session block lists
        self._kv_redis = _Redis(extra, "kv_redis_")  # block payloads and index entries
        # scheduler side
        # req id → (tenant, session, hashes, present, vLLM's local hit in blocks)
        self._lookups: dict[str, tuple[str, Optional[str], list[str], list[bool], int]] = {}
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[Transfer] = []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._header: Optional[BlockHeader] = None
        self._load_errors: set[int] = set()
        self.num_loaded_tokens = 0  # counters (per process)
        self.num_saved_blocks = 0

    # ------------------------------------------------------------------ scheduler side

    @staticmethod
    def _params(request: "Request") -> tuple[str, Optional[str], Optional[str]]:
        """Tenant, session and cache salt of ``request`` (engine.kv_transfer_params)."""
        p = getattr(request, "kv_transfer_params", None) or {}
        return str(p.get("tenant") or "default"), (p.get("session_id") or None), (p.get("cache_salt") or None)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        tenant, session_id, salt = self._params(request)
        tokens = list(request.all_token_ids)
        n_max = max(0, (len(tokens) - 1) // self._block_size)
        hashes = block_hashes(
            self._model_ns, tenant, tokens[: n_max * self._block_size], self._block_size, salt, _lora(request)
        )
        present = [False] * len(hashes)
        client = self._kv_redis.client() if hashes else None
        if client is not None:
            try:
                values = client.mget([keys.block_index_key(tenant, h + self._lookup_suffix) for h in hashes])
                present = [v is not None for v in values]
            except Exception as e:  # noqa: BLE001 - any Redis failure is a miss
                self._kv_redis.failed("lookup", e)
        local = num_computed_tokens // self._block_size
        self._lookups[request.request_id] = (tenant, session_id, salt, hashes, present, local)
        run = 0
        while local + run < len(present) and present[local + run]:
            run += 1
        if run == 0:
            return 0, False
        return (local + run) * self._block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        rid = request.request_id
        tenant, session_id, salt, hashes, present, first = self._lookups.pop(rid, None) or (
            *self._params(request), [], [], 0
        )
        self._reqs[rid] = _ReqState(request, tenant, session_id, present, salt=salt)
        if num_external_tokens <= 0 or not hashes:
            return
        block_ids = blocks.get_block_ids()[0]
        last = min(len(hashes), first + num_external_tokens // self._block_size)
        self._pending_loads.append(
            Transfer(rid, tenant, hashes[first:last], block_ids[first:last], session_id, hashes[0])
        )

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = DataPlaneConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            tokens = req.all_token_ids
            # Tokens whose KV exists after this step (request.num_computed_tokens is
            # advanced only after this call); capped at the tokens known (async scheduling).
            full = min(req.num_computed_tokens + n_sched, len(tokens)) // self._block_size
            if full <= st.next_block:
                continue
            hashes = block_hashes(
                self._model_ns, st.tenant, list(tokens[: full * self._block_size]), self._block_size, st.salt,
                _lora(req),
            )
            todo = [i for i in range(st.next_block, full) if not (i < len(st.present) and st.present[i])]
            st.next_block = full
            if not todo:
                continue
            assert self._kv_cache_manager is not None
            block_ids = self._kv_cache_manager.get_block_ids(rid)[0]
            meta.saves.append(
                Transfer(rid, st.tenant, [hashes[i] for i in todo], [block_ids[i] for i in todo],
                         st.session_id, hashes[0])
            )
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        num_blocks = self._kv_cache_config.num_blocks
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        kinds = {(t.dtype, t.device.type) for t in kv_caches.values()}
        if len(shapes) != 1 or len(kinds) != 1:
            logger.warning("KV connector off: layers have different KV shapes or dtypes %s %s", shapes, kinds)
            return
        shape = next(iter(shapes))
        dtype, device_type = next(iter(kinds))
        try:
            if shape[0] != num_blocks or shape[2] != self._block_size:
                raise ValueError(f"not [{num_blocks} blocks, heads, {self._block_size} tokens, content]")
            layout, interior = block_layout(device_type, self._cache_dtype, shape)
        except (IndexError, ValueError) as e:
            logger.warning("KV connector off: unsupported per-layer KV shape %s: %s", shape, e)
            return
        self._suffix = rank_suffix(*self._ranks())
        self._kv_caches = dict(kv_caches)  # insertion order = the model's layer order
        self._header = BlockHeader(
            dtype=str(dtype).removeprefix("torch."), shape=(len(kv_caches), *interior), layout=layout
        )
        logger.info("KV connector: blocks of %s, layout %s, key suffix %r", self._header.shape, layout, self._suffix)

    def _ranks(self) -> tuple[int, int, int, int]:
        """This worker's (tp rank, tp size, pp rank, pp size)."""
        if self._tp_size <= 1 and self._pp_size <= 1:
            return 0, 1, 0, 1
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), self._tp_size, get_pp_group().rank_in_group, self._pp_size

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DataPlaneConnectorMetadata)
        for t in meta.loads:
            good = self._load_one(t)
            # vLLM recomputes from the first invalid block on (policy "recompute").
            self._load_errors.update(t.block_ids[good:])

    def _load_one(self, t: Transfer) -> int:
        """Loads the leading good blocks of ``t``; returns how many."""
        if self._header is None:
            return 0
        client = self._kv_redis.client()
        if client is None:
            return 0
        try:
            datas = client.mget([keys.block_key(t.tenant, h + self._suffix) for h in t.hashes])
        except Exception as e:  # noqa: BLE001
            self._kv_redis.failed("load", e)
            return 0
        blocks = []
        for h, data in zip(t.hashes, datas):
            try:
                if data is None:
                    raise CorruptBlockError("payload missing")
                header, payload = decode_block(data)
                if header != self._header:
                    raise CorruptBlockError(f"header {header} is not this engine's {self._header}")
            except CorruptBlockError as e:
                logger.warning("KV connector: block %s of tenant %r is a miss: %s", h, t.tenant, e)
                # Its index entry would offer it again on every lookup (a cache Redis evicts
                # payloads on its own): drop both, so the next lookup stops before it. The
                # scheduler looks up rank 0's entry: drop that one too (a sharded engine
                # then saves every rank's part again), or it would offer this block forever.
                names = {h + self._suffix, h + self._lookup_suffix}
                try:
                    client.delete(*[keys.block_index_key(t.tenant, n) for n in names], keys.block_key(t.tenant, h + self._suffix))
                except Exception as e2:  # noqa: BLE001 - only a cleanup
                    self._kv_redis.failed("delete of a missing block", e2)
                break
            blocks.append(payload)
        with gpu_sync_allowed():
            scatter_blocks(list(self._kv_caches.values()), t.block_ids[: len(blocks)], blocks)
        self.num_loaded_tokens += len(blocks) * self._block_size
        logger.info("KV connector: loaded %d/%d blocks for %s", len(blocks), len(t.hashes), t.req_id)
        return len(blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # everything is saved after the forward, in wait_for_save

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        assert isinstance(meta, DataPlaneConnectorMetadata)
        if not meta.saves or self._header is None:
            return
        client = self._kv_redis.client()
        if client is None:
            return
        caches = list(self._kv_caches.values())
        pipe = client.pipeline(transaction=False)
        # Each session's list of its blocks goes to the durable server (deleting the
        # session deletes them); the same pipeline when both are one server.
        separate = self._kv_redis.url != self._redis.url
        members: list[tuple[str, list[str]]] = []
        n = 0
        for t in meta.saves:
            # [blocks, layers, heads, B, content] in host memory, contiguous per block.
            with gpu_sync_allowed():
                stacked = gather_blocks(caches, t.block_ids)
            names = [h + self._suffix for h in t.hashes]
            for i, name in enumerate(names):
                data = encode_block(self._header, block_bytes(stacked, i))
                pipe.set(keys.block_key(t.tenant, name), data, ex=self._kv_ttl_s + PAYLOAD_TTL_MARGIN_S)
                pipe.set(keys.block_index_key(t.tenant, name), len(data), ex=self._kv_ttl_s)
                n += 1
            if t.session_id:
                skey = keys.session_blocks_key(t.tenant, t.session_id)
                members.append((skey, [keys.session_block_member(t.chain_head, name) for name in names]))
        member_ttl = max(self._session_ttl_s, self._kv_ttl_s) + PAYLOAD_TTL_MARGIN_S

        def list_members(p) -> None:
            for skey, ms in members:
                p.sadd(skey, *ms)
                p.expire(skey, member_ttl)

        if not separate:
            list_members(pipe)
        try:
            pipe.execute()
            self.num_saved_blocks += n
        except Exception as e:  # noqa: BLE001 - a lost save is a later miss
            self._kv_redis.failed("save", e)
            return
        sessions = self._redis.client() if separate and members else None
        if sessions is not None:
            spipe = sessions.pipeline(transaction=False)
            list_members(spipe)
            try:
                spipe.execute()
            except Exception as e:  # noqa: BLE001 - the blocks then outlive a delete until their TTL
                self._redis.failed("session block list", e)
