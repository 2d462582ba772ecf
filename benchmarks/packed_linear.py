"""The CPU linear's weight forms side by side: SmolLM2's 30 layers of qkv, o, gate_up and down per
step at 1-64 rows (and 1,088, a prefill chunk), weights cycled through all 30 layers so they stream
from memory as in the model (a single layer's weights would sit in cache). Best of 3 rounds of 10
steps; the policy (kernels/cpu/linear.py c_kernel_rows) cites these figures.

    onednn    onednn_linear.pack_weight + packed_linear (oneDNN's blocked layout)
    lanes     linear.pack_lanes + csrc/lanes_linear.c (AVX-512; AVX512-BF16 in bfloat16)
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

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate_up, down
LAYERS = 30
ROWS = (1, 4, 8, 16, 64, 1088)


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
    from kernels.cpu.linear import CpuLinearWeight, has_lanes, lanes_linear, linear_covered, pack_lanes, rows_covered
    from kernels.cpu.native import native_kernels
    from kernels.cpu.onednn_linear import pack_weight, packed_linear

    forms = {"onednn": (pack_weight, packed_linear)}
    if has_lanes(dtype):
        forms["lanes"] = (lambda w: CpuLinearWeight(pack_lanes(w), None, tuple(w.shape), True, m), lanes_linear)
    native = native_kernels()
    if native is not None and m in rows_covered(native, dtype):
        forms["row"] = (lambda w: w, linear_covered)
    return forms


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="packed_linear")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        weights = [[torch.randn(n, k, dtype=dtype) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
        results[name] = {}
        for m in ROWS:
            xs = [torch.randn(m, k, dtype=dtype) for _, k in SHAPES]
            row = {}
            for form, (pack, run) in _forms(dtype, m).items():
                packed = [[pack(w) for w in layer] for layer in weights]
                row[f"{form}_ms"] = step_ms(lambda: [run(x, w) for layer in packed for x, w in zip(xs, layer)])
                del packed
            results[name][str(m)] = row
            print(f"  {name} {m} rows: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items()), flush=True)
    write_json(args.name, {"shapes": SHAPES, "layers": LAYERS, "rows": ROWS, "results": results})
    series = {f"{d} {f}": [r[str(m)].get(f"{f}_ms", 0.0) / r[str(m)]["onednn_ms"] for m in ROWS]
              for d, r in results.items() for f in ("lanes", "row") if any(f"{f}_ms" in r[str(m)] for m in ROWS)}
    bar_plot(args.name, "30 layers of linears per step: time / oneDNN's (lower is faster; 0 = not run)",
             [str(m) for m in ROWS], series, "time / oneDNN")
    print(f"{args.name}: lanes vs oneDNN (x faster): " + "; ".join(
        f"{d}: " + ", ".join(f"{m} rows {r[str(m)]['onednn_ms'] / r[str(m)]['lanes_ms']:.2f}x"
                             for m in ROWS if "lanes_ms" in r[str(m)]) for d, r in results.items()))

if __name__ == "__main__":
    main()
