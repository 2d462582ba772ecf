"""TPGroup: the tensor-parallel collectives the one model forward calls (an identity for one rank).

Row-parallel linears (attention's o_proj, the MLP's down_proj) leave each rank a partial sum:
``all_reduce`` adds them. The vocab-parallel embedding gives each rank the rows of its vocab slice
(zeros elsewhere): ``all_reduce`` again. The vocab-parallel LM head gives each rank the logits of its
slice: ``all_gather_last`` concatenates them. Gloo on CPU, NCCL on CUDA (torch.distributed's default
group, set up by engine/executor.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside tensor parallel size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., n * size], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
