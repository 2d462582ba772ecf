"""Linear: nn.Linear whose small-batch GEMMs on CPU (float32; bfloat16 with AVX512-BF16) go through a C kernel.

Decoding a handful of sequences (beams, n>1 samples, small batches) is bound by reading the weights
once per step, but the CPU BLAS behind F.linear is erratic at 2-16 rows: measured over SmolLM2's
30 layers of weights on this project's 2-core machine, 57/68/114 ms per step at 4/8/16 rows where
the weight read alone takes ~25 ms. `kernels.linear_cpu` reads each weight row once for all rows
(33/35/52 ms). Same products, same sums in another order: the results agree to float32 rounding.
In bfloat16 (2-8 rows) it reads the weights at ~20 GB/s where F.linear reached ~12.

Other row counts in float32 (1, and above 16) go to oneDNN rather than MKL's sgemm, which takes
an AVX2 path on AMD CPUs (see kernels/onednn_linear.py: 2.2x at prefill sizes here).

Without a C compiler or oneDNN the earlier fallback stays: W @ x^T for 2-10 rows, which measured
faster than F.linear there on the machine it was tuned on. The weights stay as loaded ([out, in]), so
checkpoints load by name unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import onednn_linear
from kernels.linear_cpu import covers, linear_covered

# Row counts for which W @ x^T is used (float32 on CPU) when the C kernel is unavailable.
WEIGHT_MAJOR_ROWS = range(2, 11)


def use_weight_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2 and x.shape[0] in WEIGHT_MAJOR_ROWS
        and weight.dtype == torch.float32 and weight.device.type == "cpu"
    )


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, in] -> [M, out]
        if covers(x, self.weight):
            return linear_covered(x, self.weight, self.bias)
        if onednn_linear.covers(x, self.weight):
            return onednn_linear.linear_covered(x, self.weight, self.bias)
        if not use_weight_major(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t().contiguous()  # [out, M] -> [M, out]
        return out if self.bias is None else out.add_(self.bias)
