"""The CPU linear's weight forms side by side: SmolLM2's 30 layers of qkv, o, gate_up and down per
step at 1-64 rows (and 1,088, a prefill chunk), weights cycled through all 30 layers so they stream
from memory as in the model (a single layer's weights would sit in cache). Best of 3 rounds of 10
steps; the policy (kernels/cpu/linear.py c_kernel_rows) cites these figures.

    onednn    onednn_linear.pack_weight + packed_linear (oneDNN's blocked layout)
    lanes     linear.pack_lanes + csrc/lanes_linear.c (AVX-512; AVX512-BF16 in bfloat16)
    amx       the same lanes layout through csrc/amx_linear.c (bfloat16 on AMX tiles)
    row       the plain weight through csrc/linear.c (1-16 rows in float32, 1-8 in bfloat16)

Prints one summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/packed_linear.py [--name packed_linear]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import bar_plot, write_json  # noqa: E402

# (N, K) of qkv, o, gate_up, down, and the layers, per model shape
MODELS = {"smollm2-135m": (((960, 576), (576, 576), (3072, 576), (576, 1536)), 30),
          "llama-3.2-1b": (((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)), 16)}
ROWS = (1, 4, 8, 16, 32, 64, 1088)


def step_ms(fn, rounds: int = 3, steps: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


def _forms(dtype: torch.dtype, m: int) -> dict:
    """name -> (pack(weight), run(x, packed)) for the forms this CPU has at m rows."""
    from kernels.cpu.linear import (CpuLinearWeight, amx_linear, has_amx_linear, has_lanes, lanes_linear, linear_covered,
                                    pack_lanes, rows_covered)
    from kernels.cpu.native import native_kernels
    from kernels.cpu.onednn_linear import pack_weight, packed_linear

    forms = {"onednn": (pack_weight, packed_linear)}
    if has_lanes(dtype):
        forms["lanes"] = (lambda w: CpuLinearWeight(pack_lanes(w), None, tuple(w.shape), True, m), lanes_linear)
    if has_amx_linear(dtype):
        forms["amx"] = (lambda w: CpuLinearWeight(pack_lanes(w), None, tuple(w.shape), True, m), amx_linear)
    native = native_kernels()
    if native is not None and m in rows_covered(native, dtype):
        forms["row"] = (lambda w: w, linear_covered)
    return forms


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default=None, help="results file (default: packed_linear, or packed_linear_<model>)")
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    args = ap.parse_args()
    args.name = args.name or ("packed_linear" if args.model == "smollm2-135m" else f"packed_linear_{args.model}")
    shapes, layers = MODELS[args.model]
    rows_run = tuple(args.rows)
    torch.manual_seed(0)
    results = {}
    for dtype in (getattr(torch, d) for d in args.dtypes):
        name = str(dtype).removeprefix("torch.")
        weights = [[torch.randn(n, k, dtype=dtype) * 0.05 for n, k in shapes] for _ in range(layers)]
        results[name] = {}
        for m in rows_run:
            xs = [torch.randn(m, k, dtype=dtype) for _, k in shapes]
            row = {}
            for form, (pack, run) in _forms(dtype, m).items():
                packed = [[pack(w) for w in layer] for layer in weights]
                row[f"{form}_ms"] = step_ms(lambda: [run(x, w) for layer in packed for x, w in zip(xs, layer)])
                del packed
            results[name][str(m)] = row
            print(f"  {name} {m} rows: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items()), flush=True)
    write_json(args.name, {"model": args.model, "shapes": shapes, "layers": layers, "rows": rows_run,
                           "results": results})
    forms = ("lanes", "amx", "row")
    series = {f"{d} {f}": [r[str(m)].get(f"{f}_ms", 0.0) / r[str(m)]["onednn_ms"] for m in rows_run]
              for d, r in results.items() for f in forms if any(f"{f}_ms" in r[str(m)] for m in rows_run)}
    bar_plot(args.name, f"{layers} layers of linears per step: time / oneDNN's (lower is faster; 0 = not run)",
             [str(m) for m in rows_run], series, "time / oneDNN")
    print(f"{args.name}: x faster than oneDNN: " + "; ".join(
        f"{d} {f}: " + ", ".join(f"{m} rows {r[str(m)]['onednn_ms'] / r[str(m)][f + '_ms']:.2f}x"
                                 for m in rows_run if f + "_ms" in r[str(m)])
        for d, r in results.items() for f in forms if any(f"{f}_ms" in r[str(m)] for m in rows_run)))

if __name__ == "__main__":
    main()
