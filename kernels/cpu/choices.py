"""The CPU op choices made by measurement at bind (kernels/cpu/dispatch.py), one function per op:

    linear_small_rows(dispatch, weight, gated, ...)  rows the C linear takes before the GEMM form (dense weights)
    lm_head_spans(dispatch, qw)                      which kernel computes an int8 LM head's logits, per row count
    int4_layout(dispatch, n, k, group_size)          the int4 weight layout (C kernel or torch's), per shape
    gemm_form(dispatch, weight, candidates)          a dense weight's GEMM form (bfloat16 without oneDNN's kernels)

Each times its eligible implementations on inputs of the model's own shapes, with enough copies of the
weight that they stream from memory as in a forward (a weight that sits in the cache flatters the
kernel that reads it least efficiently), and checks each against the reference.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from .dispatch import EVERY, Dispatcher

LINEAR_ROWS = (1, 4, 8, 16, 32, 64, 256, 512)  # decode batches, then prefill chunks (GEMM efficiency levels off)
HEAD_ROWS = (1, 4, 8, 16, 32, 64)  # an LM head computes logits only where a token is sampled
INT4_ROWS = (1, 8, 64, 512)
STREAM_BYTES = 64 << 20  # copies of a small weight until they exceed the last-level cache
MAX_COPIES = 16


def copies_of(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-STREAM_BYTES // max(nbytes, 1))))


def rotating(call: Callable, forms: list) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(x) calling ``call(x, form)`` on the next of ``forms`` each time (each call reads a cold weight)."""
    cycle = itertools.cycle(forms)
    return lambda x: call(x, next(cycle))


def linear_small_rows(dispatch: Dispatcher, weight: torch.Tensor, *, gated: bool, small: tuple, large: tuple,
                      limit: int, rows: tuple[int, ...] = LINEAR_ROWS) -> int:
    """Up to how many rows the C kernel's form (``small``: (name, pack, call)) beats the GEMM form
    (``large``: (name, pack, call)) on this weight's shape: 0, a row count, or EVERY (every row count).
    ``gated``: an MLP's gate_up through linear + SiLU-and-multiply; ``limit``: the most rows the C kernel
    takes. A second form is kept only where it saves >= 10% (it is a second copy of the weight)."""
    n, k = weight.shape
    (small_name, small_pack, small_call), (large_name, large_pack, large_call) = small, large

    def setup():
        weights = [weight] + [weight.clone() for _ in range(copies_of(weight.numel() * weight.element_size()) - 1)]
        candidates = {small_name: rotating(small_call, [small_pack(w) for w in weights]),
                      large_name: rotating(large_call, [large_pack(w) for w in weights])}
        gen = torch.Generator().manual_seed(0)
        return candidates, lambda m: torch.randn(m, k, generator=gen).to(weight.dtype), reference

    def reference(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.float(), weight.float())
        if gated:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return y

    choice = dispatch.choose("linear_silu_mul" if gated else "linear", f"{weight.dtype} {n}x{k}",
                             [small_name, large_name], setup, tuple(r for r in rows if r <= limit),
                             tol=0.02 if weight.dtype == torch.bfloat16 else 1e-4, mode="threshold")
    upto = choice.up_to(small_name)
    return EVERY if upto >= EVERY and limit >= EVERY else min(upto, limit)


GEMM_ROWS = (64, 512)  # where the GEMM form takes over from the row kernel, and a prefill chunk


def gemm_form(dispatch: Dispatcher, weight: torch.Tensor, candidates: dict[str, tuple],
              rows: tuple[int, ...] = GEMM_ROWS) -> str:
    """The GEMM form (name -> (pack(w) -> form, call(x, form) -> y)) for a weight of this shape and dtype: one
    for every row count (each is a form of the one weight), the best over ``rows`` (an LM head computes
    logits for a step's sampled rows only: 64 at most)."""
    n, k = weight.shape

    def setup():
        weights = [weight] + [weight.clone() for _ in range(copies_of(weight.numel() * weight.element_size()) - 1)]
        gen = torch.Generator().manual_seed(0)
        fns = {name: rotating(call, [pack(w) for w in weights]) for name, (pack, call) in candidates.items()}
        return (fns, lambda m: torch.randn(m, k, generator=gen).to(weight.dtype),
                lambda x: F.linear(x.float(), weight.float()))

    choice = dispatch.choose("gemm", f"{weight.dtype} {n}x{k}", list(candidates), setup, rows,
                             tol=0.02 if weight.dtype == torch.bfloat16 else 1e-4, mode="single")
    return choice.by_rows[0][1]


def lm_head_spans(dispatch: Dispatcher, qw, candidates: dict[str, Callable[[], Callable]],
                  second_copies: dict[str, float] | None = None) -> tuple[tuple[int, str], ...]:
    """Which of ``candidates`` (name -> a builder of fn(x [M, K]) -> logits [M, V]) computes an int8 LM head's
    logits at each row count, measured against the float32 product of its int8 rows. ``second_copies``:
    candidates that hold a second copy of the table, each with the speed-up over the best of the others it
    must bring at a row count to be bound there."""
    from ..quant_linear import dequantize

    def setup():
        table = dequantize(qw)  # [V, K] float32
        gen = torch.Generator().manual_seed(0)
        return ({name: build() for name, build in candidates.items()},
                lambda m: torch.randn(m, qw.in_features, generator=gen), lambda x: x.float() @ table.t())

    choice = dispatch.choose("lm_head", f"int8 {qw.out_features}x{qw.in_features}", list(candidates), setup,
                             HEAD_ROWS, tol=0.05)
    return worth_their_memory(choice, second_copies or {})


GEMM_PREFILL_ROWS = (32, 128, 512, 2048)  # a prompt's rows where an int4 weight may go through the float32 GEMM


def int4_gemm_rows(dispatch: Dispatcher, qw, candidates: dict[str, Callable],
                   dtype: torch.dtype = torch.float32) -> int | None:
    """The row count above which an int4 weight's prompt rows (activations in ``dtype``) run faster widened for
    the GEMM (``candidates``: "int4_vnni" and "widened", each fn(x, qw) -> y), measured at GEMM_PREFILL_ROWS
    against the float32 product; None where the int4 kernel is as fast at each (no copy is kept either way: the
    widened form is made per call)."""
    from ..quant_linear import dequantize

    def setup():
        w = dequantize(qw)  # [N, K] float32
        gen = torch.Generator().manual_seed(0)
        return ({name: (lambda x, fn=fn: fn(x, qw)) for name, fn in candidates.items()},
                lambda m: torch.randn(m, qw.in_features, generator=gen).to(dtype), lambda x: x.float() @ w.t())

    symmetric = "sym" if qw.scales.shape[2] == 1 else "asym"
    shape = f"{qw.out_features}x{qw.in_features} g{qw.group_size} {symmetric}"
    choice = dispatch.choose("int4_prefill", shape if dtype == torch.float32 else f"{shape} {str(dtype)[6:]}",
                             list(candidates), setup, GEMM_PREFILL_ROWS, tol=0.03, mode="threshold")
    spans = choice.by_rows
    if spans[-1][1] != "widened":
        return None
    return spans[0][0] if len(spans) > 1 else min(GEMM_PREFILL_ROWS) // 2  # widened at every row measured


def worth_their_memory(choice, gains: dict[str, float]) -> tuple[tuple[int, str], ...]:
    """``choice``'s spans with at most one of the candidates of ``gains`` (each costs a copy of the weight): among
    those at least their gain faster than the best candidate that costs none at some row count, the one that
    with them is fastest over the row counts (geometric mean). Then every row count takes the fastest of what is
    kept. (Before, a row count where the kept bfloat16 head was only 1.27x faster ran the int8 kernel: 2.4
    against 1.6 ms a decode step's logits, SmolLM2's head on a 2-core AMD EPYC Zen 4. With the 8-bit tiles as a
    second candidate, timings under load once kept both: 180 MB of weights for a 135M model.)"""
    if not gains or not choice.times_ms or not set(choice.names()) & set(gains):
        return choice.by_rows
    rows_measured = sorted(map(int, next(iter(choice.times_ms.values()))))

    def best_of(names, rows: int) -> str | None:
        times = {n: choice.times_ms[n][str(rows)] for n in names if str(rows) in choice.times_ms.get(n, {})}
        return min(times, key=times.get) if times else None

    def log_time(names) -> float:
        return sum(math.log(choice.times_ms[best][str(rows)]) for rows in rows_measured
                   if (best := best_of(names, rows)) is not None)

    plain = [n for n in choice.times_ms if n not in gains]
    worth = [name for name, gain in gains.items() if name in choice.times_ms and any(
        (best := best_of(plain, rows)) is None or choice.times_ms[best][str(rows)] >= gain * choice.times_ms[name][str(rows)]
        for rows in rows_measured if str(rows) in choice.times_ms[name])]
    kept = plain + ([min(worth, key=lambda name: log_time(plain + [name]))] if worth else [])
    picks = [(rows, best_of(kept, rows) or choice.name_for(rows)) for rows in rows_measured]
    spans: list[tuple[int, str]] = []
    for rows, name in picks:
        spans = spans[:-1] + [(rows, name)] if spans and spans[-1][1] == name else spans + [(rows, name)]
    return tuple(spans[:-1]) + ((EVERY, spans[-1][1]),)


def int4_layout(dispatch: Dispatcher, n: int, k: int, group_size: int, candidates: dict[str, tuple]) -> str:
    """The int4 layout (name -> (pack(q, scale, zero) -> QuantizedWeight, run(x, qw) -> y)) for weights of
    this shape: one layout serves every row count (both would be two copies), the best over decode and
    prefill row counts."""
    def setup():
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scale = torch.rand(n, k // group_size, generator=gen) / 64 + 1e-3
        zero = torch.randn(n, k // group_size, generator=gen) / 64
        w = ((q.float() - 8).view(n, k // group_size, group_size) * scale[..., None] + zero[..., None]).view(n, k)
        fns = {}
        for name, (pack, run) in candidates.items():
            try:
                forms = [pack(q, scale, zero) for _ in range(copies_of(n * k // 2))]
            except Exception:  # a layout that cannot hold this shape is not eligible
                continue
            fns[name] = rotating(run, forms)
        return fns, lambda m: torch.randn(m, k, generator=gen), lambda x: x.float() @ w.t()

    choice = dispatch.choose("int4_linear", f"{n}x{k} g{group_size}", list(candidates), setup, INT4_ROWS,
                             tol=0.03, mode="single")
    return choice.by_rows[0][1]
