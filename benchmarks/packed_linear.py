"""Linears with plain vs prepacked (oneDNN blocked layout) weights: SmolLM2's 30 layers of qkv, o,
gate_up and down per step at 1-64 rows (and 1,088, a prefill chunk), weights cycled through all 30
layers so they stream from memory as in the model (a single layer's weights would sit in cache).
"plain" is the bound CPU op set's previous policy (C kernel at 2-16 rows in float32 / 2-8 in bfloat16,
oneDNN otherwise in float32, F.linear in bfloat16); "packed" is onednn_linear.pack_weight +
packed_linear, which the bound ops now use for every row count. Best of 3 rounds of 10 steps.
Prints one summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/packed_linear.py
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
ROWS = (1, 4, 16, 64, 1088)


def step_ms(fn, rounds: int = 3, steps: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


def main() -> None:
    from kernels import get_ops
    from kernels.cpu.onednn_linear import pack_weight, packed_linear
    from kernels.cpu.ops import cpu_linear

    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        plain_policy = cpu_linear if dtype == torch.float32 else get_ops("cpu", torch.device("cpu"), dtype).linear
        weights = [[torch.randn(n, k, dtype=dtype) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
        packed = [[pack_weight(w) for w in layer] for layer in weights]
        results[name] = {}
        for m in ROWS:
            xs = [torch.randn(m, k, dtype=dtype) for _, k in SHAPES]
            plain = step_ms(lambda: [plain_policy(x, w) for layer in weights for x, w in zip(xs, layer)])
            pk = step_ms(lambda: [packed_linear(x, w) for layer in packed for x, w in zip(xs, layer)])
            results[name][str(m)] = {"plain_ms": plain, "packed_ms": pk, "speedup": plain / pk}
            print(f"  {name} {m} rows: plain {plain:.2f} ms, packed {pk:.2f} ms ({plain / pk:.2f}x)", flush=True)
    write_json("packed_linear", {"shapes": SHAPES, "layers": LAYERS, "rows": ROWS, "results": results})
    bar_plot("packed_linear", "30 layers of linears per step: plain / packed (x)", [str(m) for m in ROWS],
             {d: [r[str(m)]["speedup"] for m in ROWS] for d, r in results.items()}, "speed-up")
    print("packed_linear: " + "; ".join(f"{d}: " + ", ".join(f"{m} rows {v['speedup']:.2f}x" for m, v in r.items())
                                        for d, r in results.items()))


if __name__ == "__main__":
    main()
