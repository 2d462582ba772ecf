"""CPU C kernels vs the torch paths they replace, at SmolLM2-135M's shapes (random weights).

Per op, the same inputs through our kernel (a C kernel; oneDNN for large float32 linears) and
through the torch path it replaces (for linears: F.linear), each timed back to back in one
process; reports milliseconds and the ratio ("c_ms" is ours).

* decode attention (9 query / 3 KV heads, head_dim 64, blocks of 16 scattered over a pool larger
  than the caches), per layer: batch 64 at 350 tokens (offline decode), 4 at 530 (beam search),
  and 64 sequences over shared 1,024-token prefixes (4 x 16 as in GSP, 1 x 64);
* prefill attention, per layer: 5 prompts of 410 tokens, one 2,048-token prompt, a 512-token
  chunk after 1,536 cached tokens, 64 tokens after 1,024 cached (cached time to first token) and
  16 x 64 after a shared 1,024 (GSP's prefill) (bfloat16 on an AMX CPU: the C kernel's AMX item);
* linears over all 30 layers' weights (qkv, o, gate_up, down) plus the tied lm_head, one decode
  step at 4 / 8 / 16 rows: bound by reading ~540 MB (float32) or ~270 MB (bfloat16) of weights;
* float32 linears through oneDNN (kernels/cpu/onednn_linear.py) vs F.linear (MKL), the same 30
  layers: one decode step at 1 and 64 rows, and a 2,048-token prefill chunk;
* int4 linears (kernels/cpu/int4_linear.py, AVX512-VNNI) vs torch's int4 kernel
  (_weight_int4pack_mm_for_cpu), the same 30 layers' weights in groups of 32: one decode step at
  1 and 8 rows, 64 rows, and a 1,088-token prefill chunk;
* the decoder layer's elementwise ops (residual add + RMSNorm, SiLU-and-multiply, rotary) at 4
  rows (decode) and 2,048 rows (a prefill chunk);
* the sampler's top-p filter and exponential race (kernels/sampling.py) on 8 rows of 49,152 logits
  (n=8), against their torch references (float32 logits, so listed under float32 only).

One summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/cpu_kernels.py [--cold] [--cases attention prefill ...]

--cold flushes the caches before each timed attention call (decode and prefill): the state a layer
finds its KV in during a forward. Quote attention changes from it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import save_figure, write_json  # noqa: E402

HIDDEN, INTER, HQ, HKV, D, LAYERS, VOCAB, BS = 576, 1536, 9, 3, 64, 30, 49152, 16


class ColdCaches:
    """Called before each timed call of the attention cases with --cold: writes a buffer larger than any
    L3 here, so the call finds its KV, queries and scratch in memory, as a layer's attention does in a
    forward after the weights have streamed through the caches. Warm timings misled once: in-place decode
    without a prefetch measured 15-19% faster warm and 19% slower flushed (2-core AMD EPYC Zen 5)."""

    def __init__(self, mib: int = 256) -> None:
        self.buf = torch.zeros(mib << 18)  # float32: 4 bytes each

    def __call__(self) -> None:
        self.buf.add_(1.0)


def ms(fn, repeat: int, before=None) -> float:
    """Median of `repeat` timings after two warm-up calls (`before`, if given, runs untimed before each)."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attention_cases(dtype: torch.dtype, repeat: int, before=None) -> dict:
    from kernels.cpu.paged_attention import paged_attention_decode_cpu
    from kernels.paged_attention_decode import paged_attention_decode_torch

    out = {}
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in ((64, 350), (4, 530)):
        nblk = -(-ctx // BS)
        pool = max(3000, batch * nblk)
        k = torch.randn(pool, BS, HKV, D, generator=gen).to(dtype)
        v = torch.randn(pool, BS, HKV, D, generator=gen).to(dtype)
        table = torch.randperm(pool, generator=gen)[: batch * nblk].view(batch, nblk).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
        args = (q, k, v, table, lens, D**-0.5)
        out[f"attention b{batch} ctx{ctx}"] = {
            "c_ms": ms(lambda: paged_attention_decode_cpu(*args), repeat, before),
            "torch_ms": ms(lambda: paged_attention_decode_torch(*args), repeat, before),
        }
    out.update(shared_prefix_cases(dtype, repeat, gen, before))
    return out


def shared_prefix_cases(dtype: torch.dtype, repeat: int, gen: torch.Generator, before=None) -> dict:
    """Decode over shared prefixes (GSP: 4 prompts x 16 questions; 64 samples of one prompt): 1,024
    shared tokens + 64-79 own each, the kernel's scratch reused across calls as the engine does."""
    from kernels.cpu.paged_attention import paged_attention_decode_cpu
    from kernels.cpu.scratch import Scratch
    from kernels.paged_attention_decode import paged_attention_decode_torch

    out = {}
    for groups, per in ((4, 16), (1, 64)):
        ids = iter(torch.randperm(6000, generator=gen).tolist())
        tables, lens = [], []
        for _ in range(groups):
            prefix = [next(ids) for _ in range(1024 // BS)]
            for i in range(per):
                own = 64 + i % 16
                tables.append(prefix + [next(ids) for _ in range(-(-own // BS))])
                lens.append(1024 + own)
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        k = torch.randn(6000, BS, HKV, D, generator=gen).to(dtype)
        v = torch.randn(6000, BS, HKV, D, generator=gen).to(dtype)
        q = torch.randn(len(lens), HQ, D, generator=gen).to(dtype)
        args = (q, k, v, table, torch.tensor(lens, dtype=torch.int32), D**-0.5)
        scratch = Scratch()
        out[f"attention shared {groups}x{per} ctx1024+64"] = {
            "c_ms": ms(lambda: paged_attention_decode_cpu(*args, scratch=scratch), repeat, before),
            "torch_ms": ms(lambda: paged_attention_decode_torch(*args), max(3, repeat // 4), before),
        }
    return out


def prefill_attention_cases(dtype: torch.dtype, repeat: int, before=None) -> dict:
    """Per layer: 5 prompts of 410 tokens, one of 2,048, a 512-token chunk after 1,536 cached, 64 new
    tokens after 1,024 cached (the cached time-to-first-token workload), and 16 x 64 new tokens after
    the same 1,024 cached (GSP's questions under one system prompt: its blocks shared by all 16)."""
    from kernels.cpu.paged_attention import paged_attention_prefill_cpu
    from kernels.cpu.scratch import Scratch
    from kernels.paged_attention_prefill import paged_attention_prefill_torch

    out = {}
    gen = torch.Generator().manual_seed(3)
    for label, q_lens, ctx_lens, shared in (("5x410", [410] * 5, [410] * 5, 0), ("1x2048", [2048], [2048], 0),
                                            ("chunk 512 after 1536", [512], [2048], 0),
                                            ("64 after 1024 cached", [64], [1088], 0),
                                            ("16x64 after a shared 1024", [64] * 16, [1088] * 16, 1024)):
        nblk = -(-max(ctx_lens) // BS)
        pool = max(3000, len(ctx_lens) * nblk)
        k = torch.randn(pool, BS, HKV, D, generator=gen).to(dtype)
        v = torch.randn(pool, BS, HKV, D, generator=gen).to(dtype)
        table = torch.randperm(pool, generator=gen)[: len(ctx_lens) * nblk].view(len(ctx_lens), nblk).to(torch.int32)
        table[:, : shared // BS] = table[0, : shared // BS]  # the prefix's blocks, the same ids in every row
        q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
        starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        args = (q, k, v, table, torch.tensor(ctx_lens, dtype=torch.int32), starts, D**-0.5)
        scratch = Scratch()  # reused across calls, as the bound ops keep one
        out[f"prefill attention {label}"] = {
            "c_ms": ms(lambda: paged_attention_prefill_cpu(*args, scratch=scratch), max(3, repeat // 4), before),
            "torch_ms": ms(lambda: paged_attention_prefill_torch(*args), max(3, repeat // 4), before),
        }
    return out


def onednn_linear_cases(dtype: torch.dtype, repeat: int) -> dict:
    from kernels.cpu.onednn_linear import covers, linear_covered

    # bfloat16 (F.linear is oneDNN already) or no oneDNN here: no case
    return _linear_step_cases("onednn linear 30 layers", covers, linear_covered, dtype, repeat, (1, 64, 2048),
                              lm_head=False, seed=4)


def linear_cases(dtype: torch.dtype, repeat: int) -> dict:
    from kernels.cpu.linear import covers, linear_covered

    return _linear_step_cases("linear step", covers, linear_covered, dtype, repeat, (4, 8, 16), lm_head=True, seed=1)


def _linear_step_cases(label: str, covers, ours, dtype: torch.dtype, repeat: int, row_counts, lm_head: bool,
                       seed: int) -> dict:
    """All 30 layers' linears (plus the lm_head) at each row count ``ours`` covers, vs F.linear."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [((HQ + 2 * HKV) * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in shapes + [(VOCAB, HIDDEN)] * lm_head]
    out = {}
    for rows in row_counts:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTER)}
        if not covers(xs[HIDDEN], weights[0]):
            continue  # rows (or a dtype) ours does not take

        def step(fn):
            for w in weights:
                fn(xs[w.shape[1]], w)

        out[f"{label} {rows} rows"] = {
            "c_ms": ms(lambda: step(ours), max(3, repeat // 4)),
            "torch_ms": ms(lambda: step(F.linear), max(3, repeat // 4)),
        }
    return out


def int4_linear_cases(dtype: torch.dtype, repeat: int) -> dict:
    import dataclasses

    from kernels.cpu import int4_linear
    from kernels.quant_linear import int4_from_groups, int4_groups_of_float, quantized_linear

    if not int4_linear.supports(HIDDEN, HIDDEN, 32):
        return {}
    gen = torch.Generator().manual_seed(5)
    shapes = [((HQ + 2 * HKV) * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS
    ours, theirs = [], []
    for n, k in shapes:
        parts = int4_groups_of_float(torch.randn(n, k, generator=gen) * 0.05)
        ours.append(int4_from_groups(*parts))
        supports, int4_linear.supports = int4_linear.supports, lambda *shape: False
        try:
            theirs.append(int4_from_groups(*parts))  # torch's packing
        finally:
            int4_linear.supports = supports
    assert {w.layout for w in ours} == {"int4_vnni"} and {w.layout for w in theirs} == {"int4"}
    out = {}
    for rows in (1, 8, 64, 1088):
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTER)}

        def step(weights):
            for w in weights:
                quantized_linear(xs[w.in_features], w)

        n = max(3, repeat // 4) if rows <= 64 else 3
        out[f"int4 linears 30 layers, {rows} rows"] = {"c_ms": ms(lambda: step(ours), n),
                                                        "torch_ms": ms(lambda: step(theirs), n)}
    return out


def elementwise_cases(dtype: torch.dtype, repeat: int) -> dict:
    from kernels import elementwise as ref
    from kernels.cpu import elementwise as ew

    gen = torch.Generator().manual_seed(2)
    out = {}
    for rows in (4, 2048):
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        h = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
        gate_up = torch.randn(rows, 2 * INTER, generator=gen).to(dtype)
        qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
        angles = torch.arange(rows).float()[:, None] * torch.rand(D // 2, generator=gen)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

        def fresh_qk():  # rotary runs in place: a fresh q/k slice per call, for both sides
            return qkv.clone()[:, : (HQ + HKV) * D].view(rows, HQ + HKV, D)

        out[f"add+rmsnorm {rows} rows"] = {"c_ms": ms(lambda: ew.add_rms_norm_cpu(x, h, w, 1e-5), repeat),
                                           "torch_ms": ms(lambda: ref.add_rms_norm_torch(x, h, w, 1e-5), repeat)}
        out[f"silu*up {rows} rows"] = {"c_ms": ms(lambda: ew.silu_mul_cpu(gate_up), repeat),
                                       "torch_ms": ms(lambda: ref.silu_mul_torch(gate_up), repeat)}
        out[f"rotary {rows} rows"] = {"c_ms": ms(lambda: ew.rope_cpu(fresh_qk(), cos, sin), repeat),
                                      "torch_ms": ms(lambda: ref.rope_torch(fresh_qk(), cos, sin), repeat)}
    return out


def sampling_cases(dtype: torch.dtype, repeat: int) -> dict:
    from kernels.sampling import race, race_torch, top_k_top_p_probs, top_k_top_p_probs_torch

    if dtype != torch.float32:  # the sampler's logits are float32 whatever the model dtype
        return {}
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5)) * 3  # [8, V]
    ks, ps = torch.full((8,), VOCAB), torch.full((8,), 0.95)
    probs = top_k_top_p_probs(logits, ks, ps)
    seeds = torch.arange(8)
    return {
        "top-p 0.95 filter 8 x 49152": {"c_ms": ms(lambda: top_k_top_p_probs(logits, ks, ps), repeat),
                                        "torch_ms": ms(lambda: top_k_top_p_probs_torch(logits, ks, ps), repeat)},
        "race 8 x 49152": {"c_ms": ms(lambda: race(probs, seeds), repeat),
                           "torch_ms": ms(lambda: race_torch(probs, seeds), repeat)},
    }


def plot(name: str, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{d} {label}" for d, cases in results.items() for label in cases]
    values = [c["speedup"] for cases in results.values() for c in cases.values()]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(labels) + 1))
    bars = ax.barh(range(len(labels)), values)
    ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("torch time / our time")
    ax.set_title("CPU kernels (C, oneDNN) vs the torch path (SmolLM2 shapes)")
    save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--name", default="cpu_kernels")
    ap.add_argument("--cases", nargs="+", default=["attention", "prefill", "linear", "onednn", "int4", "elementwise",
                                                        "sampling"])
    ap.add_argument("--cold", action="store_true",
                    help="flush the caches before each timed attention call (the state a forward leaves them in)")
    args = ap.parse_args()
    before = ColdCaches() if args.cold else None

    from kernels.cpu.native import native_kernels

    if native_kernels() is None:
        sys.exit("cpu_kernels: the C kernels are unavailable here (no C compiler, or PREFIXSERVE_NATIVE_KERNELS=0)")
    results = {}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        groups = {"attention": partial(attention_cases, before=before),
                  "prefill": partial(prefill_attention_cases, before=before), "linear": linear_cases,
                  "onednn": onednn_linear_cases, "int4": int4_linear_cases, "elementwise": elementwise_cases,
                  "sampling": sampling_cases}
        cases = {label: case for g in args.cases for label, case in groups[g](dtype, args.repeat).items()}
        for case in cases.values():
            case["speedup"] = case["torch_ms"] / case["c_ms"]
        results[name] = cases
        for label, case in cases.items():
            print(f"  {name} {label}: C {case['c_ms']:.3f} ms, torch {case['torch_ms']:.3f} ms, "
                  f"{case['speedup']:.2f}x", flush=True)
    write_json(args.name, {"workload": {"model_shapes": "SmolLM2-135M", "repeat": args.repeat, "cold_attention": args.cold,
                                        "threads": torch.get_num_threads()}, "results": results})
    plot(args.name, results)
    summary = "; ".join(f"{d}: " + ", ".join(f"{label} {c['speedup']:.1f}x" for label, c in cases.items())
                        for d, cases in results.items())
    print(f"cpu_kernels: our kernels' speedup over the torch path: {summary}")


if __name__ == "__main__":
    main()
