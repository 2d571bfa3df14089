"""KV-block reuse between an engine and the data plane: hashing, the connector interface
and the fetch-or-recompute decision. No torch, no Ray: the router imports this too.

A *block* is the K/V of ``block_size`` consecutive tokens for every layer. Blocks are named
by a chained hash, as vLLM's prefix caching does: block i's hash covers the model, the
tenant, block i-1's hash and block i's token ids, so equal hashes mean equal whole prefixes
and one tenant's blocks can never be found by another.
"""

from __future__ import annotations

import abc
import hashlib
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

# Tiers, fastest first. L1 is the engine's own cache: it never crosses this interface,
# but the engine's fetch-or-recompute decision measures it like the others.
TIER_L1 = "L1"
TIER_L2 = "L2"
TIER_L3 = "L3"
TIER_NONE = "none"


def block_hashes(
    model_id: str,
    tenant: str,
    token_ids: Sequence[int],
    block_size: int,
    salt: Optional[str] = None,
    lora: Optional[str] = None,
) -> list[str]:
    """Chained hashes (hex) of the *full* blocks of ``token_ids``; a partial tail is
    skipped. The chain's root covers the model, the LoRA adapter that computed the KV
    (``lora``, its name; None: the base model), the tenant and the request's
    ``cache_salt`` (vLLM's field: a client's own key to its cached prefixes), so blocks
    are shared only by requests that agree on all four."""
    hashes: list[str] = []
    root = f"{model_id}\x00{tenant}".encode()
    # Tenant names have no NUL (auth.TENANT_RE), so no tenant reads as a salted one, nor
    # as one with an adapter.
    if lora:
        root += b"\x00lora\x00" + lora.encode()
    if salt:
        root += b"\x00salt\x00" + hashlib.blake2b(salt.encode(), digest_size=16).digest()
    parent = hashlib.blake2b(root, digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(struct.pack(f"<{len(block)}q", *block))
        parent = h.digest()
        hashes.append(parent.hex())
    return hashes


def prompt_lookup_hashes(model_id: str, request, block_size: int) -> list[str]:
    """The block hashes ``request``'s prompt is looked up by, wherever that happens (the
    engine, the router's early lookup, prefix-aware placement): its tenant's, cache
    salt's and adapter's chain over every prompt token but the last, which is always
    prefilled for the first output's logits."""
    return block_hashes(
        model_id,
        request.tenant,
        request.prompt_token_ids[:-1],
        block_size,
        getattr(request, "cache_salt", None),
        getattr(request, "lora", None),
    )


@dataclass(slots=True)
class PrefixHit:
    """The longest run of leading blocks the data plane holds."""

    num_blocks: int
    # The slowest tier any of those blocks sits in (what bounds the fetch time).
    tier: str = TIER_NONE
    num_bytes: int = 0
    # When asked for and every block is in L2 (or, with ``direct_l3``, in any tier): the
    # blocks already, as the data plane's ``get_block_refs`` segments (references, nothing
    # copied; blocks only in Redis by hash, for the worker to read), so no second call is
    # needed.
    refs: Optional[list] = None


class CheckedBlocks(list):
    """Blocks a store hands over already checked (header and checksum), each one since it
    was last written: the data plane checks every block on its way in, from a worker or
    from Redis, and then holds it in read-only memory. The engine still checks each
    header against its model (dtype, shape, layout) but skips the checksum pass."""


class KVConnector(abc.ABC):
    """What an engine needs from a KV store. Implementations must never raise to the
    engine on a store failure: a failure is a miss (and a metric), never a failed request."""

    block_size: int

    @abc.abstractmethod
    async def lookup(self, tenant: str, hashes: list[str], *, started=None) -> PrefixHit:
        """How many leading blocks of ``hashes`` are stored, and where. ``started``: the
        same lookup already under way (a request's ``kv_lookup``, started by the router),
        to await instead of asking again; a store that cannot use it ignores it."""

    @abc.abstractmethod
    async def load(self, tenant: str, hashes: list[str]) -> Optional[list[bytes | memoryview]]:
        """The encoded blocks for ``hashes`` (all of them, in order; bytes or read-only
        views), or None if any is missing or fails its checksum. A :class:`CheckedBlocks`
        says the store has checked them already."""

    @abc.abstractmethod
    def save(
        self,
        tenant: str,
        hashes: list[str],
        blocks: list[bytes],
        session_id: Optional[str] = None,
        *,
        chain_root: Optional[str] = None,
    ) -> None:
        """Store encoded blocks; returns at once (write-behind), errors are logged.
        ``session_id``: the session whose turn computed them, which lists them so that
        deleting the session erases them. ``hashes`` may continue a chain stored earlier
        (a session's next turn exports only its new blocks): ``chain_root`` is then the
        chain's first hash (default ``hashes[0]``), which a sharded store uses to keep
        the whole chain together, on the shard its lookups go to."""

    def record_fetch(self, tier: str, num_bytes: int, seconds: float) -> None:
        """Feed the bandwidth estimate of a tier (optional)."""

    def bandwidth_bytes_per_s(self, tier: str) -> Optional[float]:
        """Measured bandwidth of a tier, None until measured."""
        return None

    def forget_bandwidth(self) -> None:
        """Drop the measured bandwidths (a store that measures none has nothing to drop)."""


def should_fetch(
    hit: PrefixHit,
    *,
    bandwidth_bytes_per_s: Optional[float],
    recompute_seconds: Optional[float],
) -> bool:
    """Fetch the cached prefix unless loading it is measured to be slower than prefilling
    those tokens again (``recompute_seconds``: what prefilling them adds to the request's
    prefill). Without both measurements, fetch (and so learn the bandwidth)."""
    if hit.num_blocks == 0:
        return False
    if not bandwidth_bytes_per_s or recompute_seconds is None:
        return True
    return hit.num_bytes / bandwidth_bytes_per_s < recompute_seconds


class PrefillTimeModel:
    """Prefill time of ``n`` computed tokens as ``fixed + n × per_token``, fitted by
    least squares over recent prefills (each sample's weight decays by ``decay`` per
    newer one).

    What importing a cached prefix of ``n`` tokens saves is the *marginal* cost of those
    tokens, ``n × per_token``: the request's suffix is prefilled either way, and so is
    the fixed cost of a forward pass. A plain tokens-per-second average charges the fixed
    cost to every token; after imports, the prefills an engine sees are short suffixes,
    and on a GPU their time is nearly all fixed cost, so the average overstated what
    recomputing a 2k-token prefix costs by an order of magnitude (measured on an H200 with
    ``loadtests/engine_kv.py``: the engine kept importing at 0.28× the speed of
    recomputing). Until the samples spread enough in size to fit a slope (relative spread
    ``min_spread``), the per-token cost is that average, an upper bound."""

    def __init__(self, decay: float = 0.9, min_spread: float = 0.2):
        self.decay = decay
        self.min_spread = min_spread
        # Weighted sums: weight, tokens, seconds, tokens², tokens × seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        x, y = float(tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    def _fit(self) -> Optional[tuple[float, float]]:
        """(fixed, per_token) seconds, None before the first sample."""
        if self._w <= 0 or self._x <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = max(0.0, self._xx / self._w - mean_x * mean_x)
        if var_x < (self.min_spread * mean_x) ** 2:
            return 0.0, mean_y / mean_x
        per_token = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - per_token * mean_x), per_token

    @property
    def per_token_seconds(self) -> Optional[float]:
        fit = self._fit()
        return None if fit is None else fit[1]

    @property
    def fixed_seconds(self) -> Optional[float]:
        fit = self._fit()
        return None if fit is None else fit[0]

    def marginal_seconds(self, tokens: int) -> Optional[float]:
        """What prefilling ``tokens`` more adds to a prefill; None before any sample."""
        per_token = self.per_token_seconds
        return None if per_token is None else tokens * per_token


class Ewma:
    """Exponentially weighted moving average of a rate."""

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self.value: Optional[float] = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value


class Rate:
    """A measured rate (amount per second) as the ratio of moving averages of the amounts
    and of the seconds they took. A ratio of averages weighs big transfers as they
    deserve: an average of per-transfer ratios lets small ones (mostly fixed per-call
    cost) drag the figure down.

    A sample more than ``reset_factor`` times faster than the current figure replaces
    it rather than being averaged in. A slow sample may be a stall that says nothing
    about the tier: a thread preempted, page faults, a lock held by another thread. In
    ``loadtests.multiturn`` one decode of 1.8 MB took 835 ms instead of ~1 ms, and with
    that sample averaged in, later imports of the tier were predicted too slow for ~10
    samples, so fetches were skipped and prefixes recomputed. A fast sample cannot come
    from a stall, so it is evidence the figure is stale. It also restarts when a large
    import follows small ones whose fixed cost held the figure down; the figure then
    leans optimistic for small prefixes, where importing and recomputing both cost
    little."""

    def __init__(self, alpha: float = 0.3, reset_factor: float = 4.0):
        self._amount = Ewma(alpha)
        self._seconds = Ewma(alpha)
        self.reset_factor = reset_factor
        self.samples = 0  # since the last reset
        self.resets = 0

    def update(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            current = self.value
            if current is not None and amount / seconds > self.reset_factor * current:
                self._amount.value = self._seconds.value = None
                self.samples = 0
                self.resets += 1
            self._amount.update(amount)
            self._seconds.update(seconds)
            self.samples += 1

    @property
    def value(self) -> Optional[float]:
        """Amount per second, None until measured."""
        amount, seconds = self._amount.value, self._seconds.value
        return amount / seconds if amount and seconds else None
