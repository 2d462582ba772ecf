"""The start-up speed self-check: one decode step and one prefill chunk of the loaded model, timed against
what this machine allows (its memory bandwidth and GEMM rate, measured once and cached beside the kernel
choices). More than 3x off logs a WARNING naming the op that takes most of the step, so that a slow path
(a library falling back to its reference kernel, say) is seen at start-up rather than by a user.

    check_speed(runner, dtype) -> SpeedReport | None

The forward runs on KV blocks no request holds yet (the pool is empty at start-up); it writes nothing any
request reads. CPU only (a GPU has benchmarks/gpu/check.sh). ``PREFIXSERVE_SPEED_CHECK=0`` skips it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from kernels.cpu.dispatch import busy

logger = logging.getLogger("prefixserve")

SWITCH = "PREFIXSERVE_SPEED_CHECK"
PREFILL_TOKENS = 64
WARN_RATIO = 3.0
LM_HEAD, BETWEEN_OPS = "lm_head", "between ops (the Python forward)"
OPS = ("linear", "linear_silu_mul", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "rope", "store_kv",
       "paged_attention_decode", "paged_attention_prefill")


@dataclass(frozen=True)
class SpeedReport:
    decode_s: float
    decode_floor_s: float
    prefill_s: float
    prefill_floor_s: float
    prefill_tokens: int
    decode_ops: dict[str, float]  # op -> share of the decode step
    prefill_ops: dict[str, float]

    def describe(self) -> str:
        return (f"decode step {self.decode_s * 1e3:.1f} ms ({self.decode_s / self.decode_floor_s:.1f}x its floor "
                f"{self.decode_floor_s * 1e3:.1f} ms), prefill of {self.prefill_tokens} tokens "
                f"{self.prefill_s * 1e3:.1f} ms ({self.prefill_s / self.prefill_floor_s:.1f}x its floor "
                f"{self.prefill_floor_s * 1e3:.1f} ms)")


def check_speed(runner, dtype: torch.dtype, weight_bytes: int, cache_dir) -> SpeedReport | None:
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no") or runner.device.type != "cpu":
        return None
    cfg, bs = runner.cfg, runner.block_size
    tokens = min(PREFILL_TOKENS, runner.kv_cache.shape[2] * bs - 1)
    if tokens < 2:
        return None
    rates = machine_rates(dtype, cache_dir)
    decode_s, decode_ops = _timed(runner, _decode_batch(runner, tokens), 3)
    prefill_s, prefill_ops = _timed(runner, prefill_batch(runner, tokens), 2)
    flops_per_token = 2 * _linear_params(cfg)  # a multiply and an add per weight (attention is small here)
    report = SpeedReport(
        decode_s, weight_bytes / rates["memory_bytes_per_s"], prefill_s,
        max(flops_per_token * tokens / rates["gemm_flops_per_s"], weight_bytes / rates["memory_bytes_per_s"]),
        tokens, decode_ops, prefill_ops)
    worst = max(report.decode_s / report.decode_floor_s, report.prefill_s / report.prefill_floor_s)
    if worst > WARN_RATIO:
        ops = report.decode_ops if report.decode_s / report.decode_floor_s >= worst else report.prefill_ops
        top, share = max(ops.items(), key=lambda kv: kv[1]) if ops else ("?", 0.0)
        logger.warning("speed check: %s: %.1fx slower than this machine's floor, %s taking %.0f%% of the step%s; "
                       "`prefixserve collect-env` lists the kernels chosen here", report.describe(), worst, top,
                       100 * share, " (other work oversubscribed the CPUs during the check)" if busy() else "")
    else:
        logger.info("speed check: %s", report.describe())
    return report


def _linear_params(cfg) -> int:
    """Weights every token multiplies: each layer's four projections and the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * layer + h * cfg.vocab_size


def _timed(runner, batch, repeats: int) -> tuple[float, dict[str, float]]:
    """Least seconds of the forward (and its logits) over ``repeats`` runs after a warm-up, and each op's
    share of the quickest of ``repeats`` more, tallied: a tiny model's step is well under a millisecond, so
    one tallied run that the OS preempts (a busy CI machine) would share its time among no op at all. The
    shares add up to 1: the LM head is one entry, and the time outside every op (the Python forward that
    calls them) another, so the warning names what dominates even where that is no op."""
    input_ids, positions, attn = batch
    model = runner.model

    def run(seconds: dict[str, float] | None = None):
        hidden = model(input_ids, positions, runner.kv_cache, attn)
        if seconds is None:
            model.compute_logits(hidden[-1:])
            return
        before = dict(seconds)  # ops the head calls count as the head
        t0 = time.perf_counter()
        model.compute_logits(hidden[-1:])
        head = time.perf_counter() - t0
        seconds.clear()
        seconds.update(before, **{LM_HEAD: head})

    with torch.inference_mode():
        run()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        bound = model.ops
        shares: dict[str, float] = {}
        quickest = float("inf")
        try:
            for _ in range(repeats):
                seconds: dict[str, float] = defaultdict(float)
                model.ops = _tallied(bound, seconds)
                t0 = time.perf_counter()
                run(seconds)
                total = time.perf_counter() - t0
                seconds[BETWEEN_OPS] = max(total - sum(seconds.values()), 0.0)
                if total < quickest:
                    quickest, shares = total, {k: round(v / total, 3) for k, v in seconds.items()}
        finally:
            model.ops = bound
    return best, dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def _tallied(ops, seconds: dict[str, float]):
    """``ops`` with each op of OPS tallied into ``seconds``, its decode_ops too (what a decode-only step runs)."""
    wrapped = {n: _tally(seconds, n, getattr(ops, n)) for n in OPS if getattr(ops, n, None) is not None}
    if ops.decode_ops is not None:
        wrapped["decode_ops"] = _tallied(ops.decode_ops, seconds)
    return dataclasses.replace(ops, **wrapped)


def _tally(seconds: dict[str, float], name: str, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[name] += time.perf_counter() - t0
        return out
    return timed


def _decode_batch(runner, context: int):
    """One sequence's next token after ``context`` tokens in blocks 0, 1, ... (no request holds them yet)."""
    bs, dev = runner.block_size, runner.device
    table = torch.arange(-(-(context + 1) // bs), dtype=torch.int32, device=dev).view(1, -1)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([context], dtype=torch.long, device=dev), num_decode_tokens=1,
        decode_block_tables=table, decode_seq_lens=torch.tensor([context + 1], dtype=torch.int32, device=dev),
        prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev), scale=runner.scale)
    return (torch.tensor([7], dtype=torch.long, device=dev), torch.tensor([context], dtype=torch.long, device=dev), attn)


def prefill_batch(runner, tokens: int):
    bs, dev = runner.block_size, runner.device
    table = torch.arange(-(-tokens // bs), dtype=torch.int32, device=dev).view(1, -1)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(tokens, dtype=torch.long, device=dev), num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=dev), prefill_block_tables=table,
        prefill_seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
        prefill_query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=dev), scale=runner.scale,
        num_prompt_tokens=tokens)
    ids = torch.arange(tokens, dtype=torch.long, device=dev) % 1000 + 100
    return ids, torch.arange(tokens, dtype=torch.long, device=dev), attn


def machine_rates(dtype: torch.dtype, cache_dir) -> dict[str, float]:
    """This machine's memory read rate and ``dtype`` matmul rate (measured once, cached per machine)."""
    from kernels.cpu.dispatch import interference, interference_mark, machine_fingerprint

    path = cache_dir / f"machine-{machine_fingerprint()}-{str(dtype).replace('torch.', '')}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    mark = interference_mark()
    rates = {"memory_bytes_per_s": read_rate(), "gemm_flops_per_s": _gemm_rate(dtype)}
    if interference(mark):  # another process's load lowers both: taken again on a quieter start
        return rates
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rates))
    except OSError:
        pass
    return rates


def read_rate(nbytes: int = 512 << 20, repeats: int = 4) -> float:
    """Bytes/s read by torch.sum over a tensor far larger than the caches (all threads), best of ``repeats``."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _gemm_rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of an n x n x n product through the fastest GEMM the CPU ops have (oneDNN with a packed weight:
    MKL's float32 GEMM takes an AVX2 path on AMD CPUs, kernels/cpu/onednn_linear.py)."""
    from kernels.cpu.onednn_linear import pack_weight, packed_linear

    x, w = torch.randn(n, n).to(dtype), pack_weight(torch.randn(n, n).to(dtype))
    run = (lambda: packed_linear(x, w)) if w.is_mkldnn else (lambda: x @ w.t())
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
