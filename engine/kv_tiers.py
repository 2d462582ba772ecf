"""Engine glue for the slower KV tiers (prefix_cache/tiers.py).

``build_kv_tiers`` turns an EngineConfig into a ``prefix_cache.KVTiers`` (host slots and/or the
Redis store); with both off it is the null tiers object, a KVTiers with neither, which moves nothing.  ``KVMover`` is the tensor half, owned by the model
runner: it holds the host slots tensor and performs each step's ``KVTransfers``.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfigError
from engine.models.config import ModelConfig
from prefix_cache import BlockManager, HostKVPool, KVTiers, KVTransfers, LoadCostModel, TransferTimings
from prefix_cache.kv_codec import KVLayout


def block_shape(model_config: ModelConfig, block_size: int) -> tuple[int, int, int, int, int]:
    """One block's KV across all layers: [L, 2, block_size, Hkv, D] (kv_cache[:, :, b])."""
    return (model_config.num_layers, 2, block_size, model_config.num_kv_heads, model_config.head_dim)


def build_kv_tiers(
    config: EngineConfig, blocks: BlockManager, model_config: ModelConfig, fingerprint: str
) -> KVTiers:
    if config.host_kv_cache_memory == 0 and config.kv_redis_url is None:
        return KVTiers(blocks)  # the null object: no tier, no listener, nothing to move
    from prefix_cache.redis_store import layout_namespace  # redis-free helper, but lives with the store

    # Values hold whole blocks (every tensor-parallel rank's heads, gathered by rank 0), so replicas of
    # any tensor-parallel size share them: the layout of one process, rank 0 of 1.
    # An fp8 engine's blocks live under their own keys ("<model dtype>-float8_e4m3fn": the bytes depend on both)
    # and say float8_e4m3fn in their header, so a model-dtype engine never reads them, nor they its.
    kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else f"{config.dtype}-{config.kv_dtype_name}"
    namespace = layout_namespace(config.kv_redis_key_prefix, fingerprint, kv_dtype, config.block_size, 0, 1)
    layout = KVLayout(namespace, config.kv_dtype_name, block_shape(model_config, config.block_size))
    host = None
    if config.host_kv_cache_memory:
        if config.host_kv_cache_memory < layout.nbytes:
            raise InvalidConfigError(
                f"host_kv_cache_memory ({config.host_kv_cache_memory} bytes) holds no KV block of {layout.nbytes} bytes."
            )
        host = HostKVPool.from_bytes(config.host_kv_cache_memory, layout.nbytes)
    remote = None
    if config.kv_redis_url is not None:
        from prefix_cache.redis_store import RedisKVStore  # imports redis: only when configured

        remote = RedisKVStore(config.kv_redis_url, layout, ttl=config.kv_redis_ttl, timeout=config.kv_redis_timeout)
    return KVTiers(blocks, host=host, remote=remote, costs=LoadCostModel(config.block_size, config.kv_tier_policy))


def tier_stats(tiers: KVTiers) -> dict[str, int | float]:
    """Engine.stats() entries: kv_host_* and kv_redis_* counters (zeros when a tier is off)."""
    s = tiers.stats()
    return {
        "kv_host_hits": s.get("host_hits", 0),  # blocks loaded from host memory
        "kv_host_stores": s.get("host_stores", 0),  # evicted device blocks demoted to host memory
        "kv_host_evictions": s.get("host_evictions", 0),
        "kv_host_usage_perc": s.get("host_slots_used", 0) / max(s.get("host_slots", 0), 1),
        "kv_swapped_out_blocks": s.get("swapped_out_blocks", 0),
        "kv_swapped_in_blocks": s.get("swapped_in_blocks", 0),
        "kv_swap_failures": s.get("swap_failures", 0),  # preemptions that recomputed: no host room
        "kv_redis_hits": s.get("remote_hits", 0),  # blocks loaded from Redis
        "kv_redis_lookups": s.get("remote_lookups", 0),
        "kv_redis_writes": s.get("remote_writes", 0),
        "kv_redis_dropped_writes": s.get("remote_dropped_writes", 0),
        "kv_redis_failures": s.get("remote_failures", 0),
        "kv_redis_corrupt_values": s.get("remote_corrupt_values", 0) + s.get("remote_rejected", 0),
        # long retentions (engine/retention.py) kept in Redis: entries extended, absent blocks written, and
        # blocks that did not make it (the retention dropped with Redis failing or a full queue, or absent
        # there and no longer on the device)
        "kv_redis_retained_extended": s.get("remote_retained_extended", 0),
        "kv_redis_retained_writes": s.get("remote_retained_writes", 0),
        "kv_redis_retained_lost": s.get("remote_retained_lost", 0) + s.get("remote_dropped_retains", 0),
        "kv_tier_loaded_tokens": s.get("loaded_tokens", 0),
        "kv_tier_recompute_decisions": s.get("recompute_decisions", 0),
    }


class KVMover:
    """Performs KVTransfers on the KV pool ``kv_cache`` [L, 2, NB, BS, Hkv, D]; owns the host slots
    ``host`` [num_slots, L, 2, BS, Hkv, D] (pinned when the pool is on a GPU).

    Under tensor parallelism the pool holds this rank's KV heads ``heads`` = (first, count) of
    ``total_heads``; remote payloads are whole blocks (every rank's heads, the layout of one
    process), of which it keeps its own heads."""

    def __init__(self, kv_cache: torch.Tensor, num_host_slots: int, heads: tuple[int, int] | None = None,
                 total_heads: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        L, two, _, bs, hkv, d = kv_cache.shape
        self.block_shape = (L, two, bs, hkv, d)
        self.heads = heads
        self.remote_block_shape = (L, two, bs, total_heads or hkv, d)
        self.host: torch.Tensor | None = None
        if num_host_slots:
            # empty, not zeros: untouched pages cost no memory until a block lands there
            self.host = torch.empty(  # [S, L, 2, BS, Hkv, D]
                num_host_slots, *self.block_shape, dtype=kv_cache.dtype, pin_memory=self.device.type == "cuda"
            )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> TransferTimings:
        """device->host, then host->device, then remote->device (the order KVTransfers promises)."""
        kv, host = self.kv_cache, self.host
        asynchronous = self.device.type == "cuda"
        t0 = time.perf_counter()
        for block, slot in transfers.device_to_host:
            host[slot].copy_(kv[:, :, block], non_blocking=asynchronous)
        self._sync()
        t1 = time.perf_counter()
        for slot, block in transfers.host_to_device:
            kv[:, :, block].copy_(host[slot], non_blocking=asynchronous)
        self._sync()
        t2 = time.perf_counter()
        for block, payload in transfers.remote_to_device:
            kv[:, :, block].copy_(self._from_bytes(payload))
        self._sync()
        t3 = time.perf_counter()
        return TransferTimings(
            t1 - t0, len(transfers.device_to_host), t2 - t1, len(transfers.host_to_device),
            t3 - t2, len(transfers.remote_to_device),
        )

    def _from_bytes(self, payload: memoryview) -> torch.Tensor:
        with warnings.catch_warnings():  # a read-only buffer: we only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        block = raw.view(self.kv_cache.dtype).view(self.remote_block_shape)  # [L, 2, BS, Hkv (all ranks), D]
        if self.heads is None:
            return block
        first, count = self.heads
        return block[:, :, :, first:first + count]  # [L, 2, BS, this rank's Hkv, D]

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Raw bytes of each block (C order [L, 2, BS, Hkv, D]), copied out of the pool now.

        On the CPU each block gets its own buffer (a few hundred KiB, from malloc's heap, freed as the Redis
        writer sends it): one buffer for a step's whole batch was mmap'd past glibc's 32 MiB threshold and
        held until its last block was written, which showed as +45-75 MiB RSS spikes in a soak (Zen 4). On
        a GPU one pinned staging copy serves the batch."""
        if not block_ids:
            return []
        if self.device.type == "cuda":
            raw = self.read_tensor(block_ids).view(torch.uint8).numpy()  # uint8: numpy has no bfloat16
            return [memoryview(raw[i]).cast("B") for i in range(len(block_ids))]
        return [memoryview(self.kv_cache[:, :, block].contiguous().view(torch.uint8).numpy()).cast("B")
                for block in block_ids]

    @torch.inference_mode()
    def read_tensor(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' KV [n, L, 2, BS, Hkv, D] (this rank's heads), a host copy."""
        cuda = self.device.type == "cuda"
        out = torch.empty(  # [n, L, 2, BS, Hkv, D]
            len(block_ids), *self.block_shape, dtype=self.kv_cache.dtype, pin_memory=cuda
        )
        for i, block in enumerate(block_ids):  # one strided copy per block, straight into place
            out[i].copy_(self.kv_cache[:, :, block], non_blocking=cuda)
        self._sync()
        return out
