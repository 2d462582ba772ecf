"""Linear: nn.Linear whose small-batch float32 GEMMs on CPU take the faster of two equal forms.

For a few rows (decode of a handful of sequences: beams, n>1 samples, small batches), the CPU BLAS
behind F.linear(x, W) is slow on float32: measured on this project's 2-core AVX-512 machine over
SmolLM2's 30 layers of weights (cache-cold, as in a real step), W @ x^T was 2-3.7x faster for 2-5
rows and 1.1-1.3x for 6-10; equal for 1 row, mixed beyond 10, and slower for bfloat16 at every
size up to 16. Same products, same sums (one GEMM either way): the results agree to float32
rounding. The weights stay as loaded ([out, in]), so checkpoints load by name unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Row counts for which W @ x^T is used (float32 on CPU); see the module docstring.
WEIGHT_MAJOR_ROWS = range(2, 11)


def use_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2 and x.shape[0] in WEIGHT_MAJOR_ROWS
        and weight.dtype == torch.float32 and weight.device.type == "cpu"
    )


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, in] -> [M, out]
        if not use_weight_major(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t().contiguous()  # [out, M] -> [M, out]
        return out if self.bias is None else out.add_(self.bias)
