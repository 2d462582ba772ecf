"""Tensor parallelism across processes, as vLLM's multiprocessing executor does it.

    rank 0 (the engine's process)          ranks 1 .. N-1 (spawned workers)
    scheduler, block manager, sampler      no scheduler, no block manager
    ModelRunner over its shard             ModelRunner over its shard
    step: broadcast SchedulerOutput  --->  receive it, run the same execute()
          run execute()                    (their samples are discarded)

Every rank runs the very same ``execute`` on the same plain-data SchedulerOutput, so the
collectives inside the forward (engine/models/parallel.py) line up by construction; only rank 0's
outputs are used. Each rank holds its share of the weights and of the KV pool (its KV heads).
torch.distributed over gloo on CPU (NCCL on CUDA), rendezvous through a TCPStore on 127.0.0.1.
A worker that dies makes the next step raise EngineDeadError (checked before each broadcast; a
collective that loses its peer fails within the group's timeout), never a hang.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import EngineDeadError
from engine.model_runner import ModelRunner
from engine.models.config import load_model_config
from engine.models.loader import load_model
from engine.models.parallel import TPGroup
from engine.models.resolve import resolve_model
from engine.models.sharding import local_config
from kernels import get_ops
from kernels.kv_quant import kv_cache_ops, kv_cache_torch_dtype

logger = logging.getLogger("prefixserve.tp")

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def init_group(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size)


def build_shard_runner(config, rank: int, size: int, port: int, device: torch.device) -> ModelRunner:
    """A worker rank's runner: its shard of the model and of the KV pool, sized as rank 0 sized its
    own (it broadcasts the pool sizes once it has them)."""
    dtype = getattr(torch, config.dtype)
    tp = init_group(rank, size, port, device)
    folder = resolve_model(config.model)
    model_config = load_model_config(folder)
    # Dense: quantized weights run in one process (EngineConfig refuses 'gguf' with several ranks).
    model = load_model(folder, model_config, dtype, device, tp=tp, quantization="none")
    box = [None, None]
    dist.broadcast_object_list(box, src=0)
    num_blocks, num_host_slots = box
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    ops = kv_cache_ops(get_ops(config.attention_backend, device, dtype), kv_dtype, dtype)
    shard = local_config(model_config, tp)
    return ModelRunner(model, shard, num_blocks, config.block_size, ops, device, dtype, config.seed,
                       num_host_kv_slots=num_host_slots, kv_heads=(rank * shard.num_kv_heads, shard.num_kv_heads),
                       total_kv_heads=model_config.num_kv_heads, kv_cache_dtype=kv_dtype)


@dataclasses.dataclass(frozen=True)
class ReadBlocks:
    """Rank 0 asks every rank for the KV of these blocks (Redis write-through): each sends its heads."""

    block_ids: tuple[int, ...]


def read_shards(runner, block_ids) -> torch.Tensor | None:
    """Gather every rank's heads of ``block_ids`` at rank 0: [n, L, 2, BS, Hkv (all), D] there."""
    local = runner.kv_mover.read_tensor(block_ids)  # [n, L, 2, BS, this rank's Hkv, D]
    if dist.get_rank() != 0:
        dist.gather(local, None, dst=0)
        return None
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.gather(local, parts, dst=0)
    return torch.cat(parts, dim=4)


def _worker_main(config, rank: int, size: int, port: int, device: str) -> None:
    """A spawned rank: build its shard and runner as the engine does, then mirror rank 0's steps."""
    torch.set_num_threads(threads_per_rank(size))
    runner = build_shard_runner(config, rank, size, port, torch.device(device))
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        if isinstance(box[0], ReadBlocks):
            read_shards(runner, box[0].block_ids)
        else:
            runner.execute(box[0])
    dist.destroy_process_group()


@dataclasses.dataclass(eq=False)
class TensorParallelWorkers:
    """Ranks 1 .. size-1, spawned before rank 0 builds its shard (they meet it in init_group)."""

    size: int
    port: int
    processes: list[mp.Process]

    @classmethod
    def spawn(cls, config, size: int, device: str) -> TensorParallelWorkers:
        port = _free_port()
        ctx = mp.get_context("spawn")
        processes = [ctx.Process(target=_worker_main, args=(config, rank, size, port, device), daemon=True,
                                 name=f"prefixserve-tp{rank}") for rank in range(1, size)]
        for p in processes:
            p.start()
        return cls(size, port, processes)

    def check_alive(self) -> None:
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            raise EngineDeadError(f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}); "
                                  "the engine cannot run steps any more.")

    def shutdown(self, timeout: float = 10.0) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()


def _picklable(batch):
    """Remote payloads are memoryviews into Redis replies: bytes travel to the other ranks."""
    transfers = batch.transfers
    if not transfers.remote_to_device:
        return batch
    payloads = tuple((block, bytes(payload)) for block, payload in transfers.remote_to_device)
    return dataclasses.replace(batch, transfers=dataclasses.replace(transfers, remote_to_device=payloads))


class ParallelRunner:
    """Rank 0's runner: sends each step to the workers, then runs it on its own shard. Everything
    else (kv_cache, kv_mover, model ...) is the wrapped ModelRunner's."""

    def __init__(self, runner, workers: TensorParallelWorkers) -> None:
        self._runner = runner
        self._workers = workers
        self._closed = False

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, batch):
        self._workers.check_alive()
        try:
            dist.broadcast_object_list([_picklable(batch)], src=0)
            return self._runner.execute(batch)
        except RuntimeError as exc:  # a peer vanished mid-collective
            self._workers.check_alive()
            raise EngineDeadError(f"a tensor-parallel collective failed: {exc}") from exc

    def read_blocks(self, block_ids) -> list[memoryview]:
        """Whole blocks (every rank's heads) for the Redis tier's write-through."""
        if not block_ids:
            return []
        self._workers.check_alive()
        dist.broadcast_object_list([ReadBlocks(tuple(block_ids))], src=0)
        raw = read_shards(self._runner, block_ids).view(torch.uint8).numpy()
        return [memoryview(raw[i]).cast("B") for i in range(len(block_ids))]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if all(p.is_alive() for p in self._workers.processes):
            dist.broadcast_object_list([None], src=0)
        self._workers.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
