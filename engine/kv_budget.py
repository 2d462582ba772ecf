"""How many KV blocks an engine's pool gets when the config names neither a block count nor a byte budget.

On CPU the pool is resident from start-up (model_runner.zeroed_pool populates it), so its size is
memory the process holds whether or not it is used. The default therefore follows the machine and the
engine's own limits rather than a fixed 4 GiB:

    budget = min(CPU_KV_FRACTION x available memory,     # what the machine can spare
                 max_num_seqs x max_model_len tokens)    # what the scheduler could ever fill
    floor:  one max_model_len sequence (else the engine could not serve its own limit)

"available" is MemAvailable from /proc/meminfo, lowered to the cgroup's memory.max headroom when a
container sets one. The prefix cache lives in the same pool (freed blocks stay indexed until evicted),
so a larger pool keeps more prefixes; set `kv_cache_memory` or `num_kv_blocks` to choose it yourself.
`block_bytes` counts the pool's element size: with `kv_cache_dtype="fp8"` one byte, so the same budget
holds twice a bfloat16 pool's blocks and four times a float32 one's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# One eighth of available memory: ~2.9 GiB on a 24 GiB machine (SmolLM2 fp32: ~64k tokens of KV, twice
# what 64 sequences of 1,024 tokens need). A quarter left three engines per process near the machine's limit.
CPU_KV_FRACTION = 1 / 8
_GIB = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    reason: str  # one line for the start-up log

    def describe(self, block_bytes: int, dtype: str | None = None) -> str:
        """One line; ``dtype``: the pool's element type (an fp8 pool holds 1 byte per element)."""
        kind = f" of {dtype}" if dtype else ""
        return f"KV pool: {self.num_blocks} blocks{kind} ({self.num_blocks * block_bytes / _GIB:.2f} GiB), {self.reason}"


def available_memory_bytes() -> int:
    """Memory this process could still take: MemAvailable, capped by a cgroup v2 limit's headroom."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    return min(available, limit) if limit is not None else available


def default_cpu_kv_budget(*, block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
                          available_bytes: int) -> KVBudget:
    """The default CPU pool (see the module docstring); `block_bytes` is one block across all layers."""
    blocks_per_seq = -(-max_model_len // block_size)
    usable = max_num_seqs * blocks_per_seq  # the most the scheduler can hold at once
    share = int(available_bytes * CPU_KV_FRACTION) // block_bytes
    if share >= usable:
        return KVBudget(usable, f"what {max_num_seqs} sequences x {max_model_len} tokens can use")
    if share >= blocks_per_seq:
        return KVBudget(share, f"1/{round(1 / CPU_KV_FRACTION)} of {available_bytes / _GIB:.1f} GiB available memory")
    return KVBudget(blocks_per_seq, f"one {max_model_len}-token sequence (available memory is low: "
                                    f"{available_bytes / _GIB:.1f} GiB)")


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_headroom() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(int(limit) - used, 0)
    except (OSError, ValueError):
        return None
