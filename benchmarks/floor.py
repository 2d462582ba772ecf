"""This machine's floor for each benchmark workload: the least time the arithmetic and the memory
traffic allow, whatever the engine.

Measured here, once per run (this machine type varies: the CPU in the JSON says which ran):
  * GEMM rates at the model's own shapes, float32 and bfloat16, through oneDNN with prepacked
    weights (the path our CPU backend takes, kernels/cpu/onednn_linear.py; MKL's sgemm runs AVX2
    code on AMD), at prefill sizes (M = 1,024-2,048 rows) and decode sizes (M = 1-64 rows);
  * memory bandwidth, as the read rate of a 1 GiB tensor (torch.sum, all threads), best of 5.

Then, per workload, from the model's config (weights, layers, heads):
  * compute = the FLOPs of the tokens that must be computed (uncached prompt tokens, one
    token per sequence per decode step; linears 2*params_per_token, attention 4*ctx*Hq*D per
    token per layer, the LM head only where a token is sampled) at the best measured GEMM rate
    (the arithmetic the CPU sustains; oneDNN's own rate at a few rows is bound by reading the
    weights, which the memory term counts: dividing by it counted the weight read twice, and our
    1-row decode later ran under that "floor");
  * memory = each forward reads the weights once, and each decode step every sequence's
    distinct KV once (a shared prefix counted once: the floor of a cascade kernel);
  * floor = prefill max(compute, weight read) + sum over decode steps of max(step compute,
    step memory).
It ignores scheduling, sampling and Python: an engine "within 1.5x of its floor" spends at most
half as much again on everything else. Other benchmarks import `workload_floor` to print
"x of floor" beside their times.

    python benchmarks/floor.py [--model smollm2-135m-instruct] [--name floor] [--recompute]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import bar_plot, write_json  # noqa: E402

DTYPES = ("float32", "bfloat16")
PREFILL_ROWS = (1024, 2048)
DECODE_ROWS = (1, 4, 8, 64)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, folder: Path) -> ModelShape:
        c = json.loads((folder / "config.json").read_text())
        heads = c["num_attention_heads"]
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads", heads), c.get("head_dim", c["hidden_size"] // heads), c["vocab_size"])

    def linears(self) -> list[tuple[int, int]]:
        """(out, in) of one layer's GEMMs as our model runs them (q/k/v fused, gate/up fused)."""
        d, h = self.head_dim, self.hidden
        return [((self.heads + 2 * self.kv_heads) * d, h), (h, self.heads * d), (2 * self.intermediate, h),
                (h, self.intermediate)]

    @property
    def layer_params(self) -> int:
        return sum(o * i for o, i in self.linears())

    def token_flops(self, ctx: int) -> float:
        """FLOPs of one token through the layers (LM head not included) attending to ctx tokens."""
        return self.layers * (2 * self.layer_params + 4 * ctx * self.heads * self.head_dim)

    @property
    def head_flops(self) -> float:
        return 2 * self.hidden * self.vocab

    def weight_bytes(self, elem: int) -> int:
        """Bytes a decode step reads: every layer's weights and the LM head (the embedding rows
        looked up are negligible)."""
        return elem * (self.layers * self.layer_params + self.hidden * self.vocab)

    def kv_bytes(self, tokens: int, elem: int) -> int:
        return elem * tokens * self.layers * 2 * self.kv_heads * self.head_dim


# -- measurements --------------------------------------------------------------------------------
def _linear_fns(dtype: torch.dtype):
    """(pack, linear): the fastest linear this machine has, oneDNN with prepacked weights (what the
    engine's CPU ops run, kernels/cpu/onednn_linear.py), else F.linear. bfloat16 where oneDNN has no
    bfloat16 kernels (no AVX512-BF16 / AMX): torch's bfloat16 matmul is emulated there (14-16 GFLOP/s on an
    AVX2-only AMD EPYC Zen 3, a weak library rate, not the machine's), so the floor takes the weight widened to
    float32 per call (kernels/cpu/widened_linear.py, what the engine binds there; 96-107 GFLOP/s)."""
    from kernels.cpu.onednn_linear import onednn_bf16_supported, onednn_linear_available, pack_weight, packed_linear
    from kernels.cpu.widened_linear import widened_linear, widen

    if dtype == torch.bfloat16 and onednn_linear_available() and not onednn_bf16_supported():
        return widen, lambda x, w: widened_linear(x, w)
    if onednn_linear_available():
        return pack_weight, lambda x, w: packed_linear(x, w) if w.is_mkldnn else F.linear(x, w)
    return (lambda w: w), F.linear


def gemm_rate(shape: ModelShape, dtype: torch.dtype, rows: int, seconds: float = 0.5) -> float:
    """FLOP/s of one layer's linears at `rows` rows, best of repeated passes over 8 layers' worth of
    distinct weights (so decode-sized GEMMs read their weights from memory, as they do in a model)."""
    pack, fn = _linear_fns(dtype)
    layers = [[pack(torch.randn(o, i, dtype=dtype)) for o, i in shape.linears()] for _ in range(8)]
    xs = {i: torch.randn(rows, i, dtype=dtype) for _, i in shape.linears()}
    flops = 8 * 2 * rows * shape.layer_params
    best = float("inf")
    with torch.inference_mode():
        for w in layers[0]:
            fn(xs[w.shape[1]], w)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == float("inf"):
            t0 = time.perf_counter()
            for layer in layers:
                for w in layer:
                    fn(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t0)
    return flops / best


def memory_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s read by torch.sum over a tensor far larger than the caches, best of 5 (the engine's start-up
    speed check measures the same way)."""
    from engine.speed_check import read_rate

    return read_rate(nbytes, repeats=5)


def measure(shape: ModelShape) -> dict:
    rates = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        rates[name] = {str(m): gemm_rate(shape, dtype, m) for m in PREFILL_ROWS + DECODE_ROWS}
    return {"gemm_flops_per_s": rates, "memory_bytes_per_s": memory_bandwidth()}


# -- the floor of a workload ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Sequences that decode together. `groups` of `per_group` sequences share `shared` prompt
    tokens (computed once per group); each sequence adds `unique` prompt tokens of its own, of
    which `cached_unique` are already cached; all decode `output` tokens in lockstep."""

    name: str
    groups: int
    per_group: int
    shared: int
    unique: int
    output: int
    shared_cached: bool = False  # the shared prefix is already in the cache (cached-TTFT case)
    fork_after_prefill: bool = False  # n>1 / beams: one prompt computed, then per_group forks decode

    @property
    def num_seqs(self) -> int:
        return self.groups * self.per_group


WORKLOADS = (
    Workload("gsp", groups=4, per_group=16, shared=1024, unique=64, output=32),
    Workload("unique_prompts", groups=64, per_group=1, shared=0, unique=320, output=64),  # 128-512, mean 320
    Workload("n8", groups=1, per_group=8, shared=1024, unique=0, output=32, fork_after_prefill=True),
    Workload("beam4", groups=1, per_group=4, shared=512, unique=0, output=32, fork_after_prefill=True),
    Workload("cached_ttft", groups=1, per_group=1, shared=1024, unique=64, output=1, shared_cached=True),
    Workload("single_stream_decode", groups=1, per_group=1, shared=0, unique=64, output=256),
)


def workload_floor(w: Workload, shape: ModelShape, machine: dict, dtype: str) -> dict:
    peak, bw = max(machine["gemm_flops_per_s"][dtype].values()), machine["memory_bytes_per_s"]
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    # Prefill: shared prefix once per group (unless cached), then every sequence's own tokens.
    prefill_tokens, prefill_flops = 0, 0.0
    if not w.shared_cached:
        prefill_tokens += w.groups * w.shared
        prefill_flops += w.groups * sum(shape.token_flops(c) for c in range(0, w.shared, 64)) * 64
    own = w.groups * (1 if w.fork_after_prefill else w.per_group)
    if w.unique:
        prefill_tokens += own * w.unique
        prefill_flops += own * sum(shape.token_flops(w.shared + c) for c in range(0, w.unique, 16)) * 16
    prefill_flops += own * shape.head_flops  # the first token's logits
    prefill_s = max(prefill_flops / peak, shape.weight_bytes(elem) / bw)
    # Decode: every sequence one token a step; weights read once a step, distinct KV once.
    decode_s = 0.0
    seqs = w.num_seqs
    for step in range(1, w.output):
        ctx = w.shared + w.unique + step
        flops = seqs * (shape.token_flops(ctx) + shape.head_flops)
        distinct_kv = w.groups * w.shared + seqs * (w.unique + step)
        memory = shape.weight_bytes(elem) + shape.kv_bytes(distinct_kv, elem)
        decode_s += max(flops / peak, memory / bw)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "floor_s": prefill_s + decode_s,
            "prefill_tokens": prefill_tokens, "decode_steps": max(w.output - 1, 0)}


def floors(shape: ModelShape, machine: dict) -> dict:
    return {d: {w.name: workload_floor(w, shape, machine, d) for w in WORKLOADS} for d in DTYPES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model, or a shape of benchmarks/shapes.py")
    ap.add_argument("--name", default=None, help="results file (default: floor, or floor_<shape>)")
    ap.add_argument("--recompute", action="store_true",
                    help="recompute the floors of results/<name>.json from the machine figures it holds, measure nothing")
    args = ap.parse_args()
    from benchmarks._common import results_dir
    from benchmarks.shapes import SHAPES, model_path

    args.name = args.name or ("floor_" + args.model if args.model in SHAPES else "floor")
    torch.manual_seed(0)
    shape = ModelShape.from_config(model_path(args.model))
    if args.recompute:
        machine = json.loads((results_dir() / f"{args.name}.json").read_text())["machine"]
    else:
        machine = measure(shape)
    result = floors(shape, machine)
    write_json(args.name, {"model": args.model, "shape": asdict(shape), "machine": machine,
                           "workloads": {w.name: asdict(w) for w in WORKLOADS}, "floors": result})
    bar_plot(args.name, "Floor per workload (s)", [w.name for w in WORKLOADS],
             {d: [result[d][w.name]["floor_s"] for w in WORKLOADS] for d in DTYPES}, "seconds")
    g = machine["gemm_flops_per_s"]
    print("floor: " + "; ".join(
        f"{d} (GEMM {g[d]['2048'] / 1e9:.0f} GFLOP/s at 2048 rows): "
        + ", ".join(f"{w} {r['floor_s']:.2f}s" for w, r in result[d].items()) for d in DTYPES)
        + f"; memory {machine['memory_bytes_per_s'] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
