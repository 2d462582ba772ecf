"""Choosing implementations by measurement (kernels/cpu/dispatch.py, kernels/cpu/choices.py): the rules that
turn timings into a choice, the checks that keep a wrong or far slower implementation out, the cache that
makes later starts measure nothing, the override, and the choices the bound CPU ops make."""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.dispatch import EVERY, Choice, Dispatcher, _per_row, _single, _threshold

ROWS = (1, 8, 64)


def _times(table: dict[str, tuple[float, ...]]) -> dict[str, dict[str, float]]:
    return {name: {str(m): t for m, t in zip(ROWS, ts)} for name, ts in table.items()}


def test_per_row_takes_the_fastest_and_collapses_spans():
    times = _times({"a": (1.0, 2.0, 9.0), "b": (3.0, 2.01, 3.0)})
    assert _per_row(["a", "b"], times, ROWS) == ((8, "a"), (EVERY, "b"))  # 8 rows: a tie within 3% keeps a


def test_single_takes_the_best_mean_ratio():
    times = _times({"a": (1.0, 1.0, 10.0), "b": (1.2, 1.2, 1.2)})
    assert _single(["a", "b"], times, ROWS) == ((EVERY, "b"),)


def test_threshold_keeps_a_second_form_only_for_a_clear_gain():
    clear = _times({"small": (1.0, 1.0, 4.0), "large": (2.0, 2.0, 1.0)})
    assert _threshold(["small", "large"], clear, ROWS) == ((8, "small"), (EVERY, "large"))
    slight = _times({"small": (1.0, 1.0, 1.05), "large": (1.5, 1.5, 1.0)})  # 5% at 64 rows: not worth a copy
    assert _threshold(["small", "large"], slight, ROWS) == ((EVERY, "small"),)
    never = _times({"small": (2.0, 2.0, 2.0), "large": (1.0, 1.0, 1.0)})
    assert _threshold(["small", "large"], never, ROWS) == ((EVERY, "large"),)


def test_a_choice_names_its_implementation_for_every_row_count():
    c = Choice("op", "k", ((8, "a"), (EVERY, "b")), _times({"a": (1.0, 1.0, 3.0), "b": (2.0, 2.0, 2.0)}))
    assert [c.name_for(m) for m in (1, 8, 9, 64, 10_000)] == ["a", "a", "b", "b", "b"]
    assert c.up_to("a") == 8 and c.up_to("b") == 0 and c.names() == ["a", "b"]
    assert c.slowdown() == pytest.approx(1.0)
    worse = Choice("op", "k", ((EVERY, "b"),), c.times_ms)
    assert worse.slowdown() == pytest.approx(2.0)  # b at 1 and 8 rows where a takes 1.0
    assert "a for 1-8 rows, b for 9-... rows" in c.describe()


def _fake(work_s: dict[str, float], calls: dict[str, int], wrong: str | None = None):
    def make(name):
        def fn(x):
            calls[name] = calls.get(name, 0) + 1
            deadline = time.perf_counter() + work_s[name] * x.shape[0]
            while time.perf_counter() < deadline:
                pass
            return x * (2.0 if name == wrong else 1.0)
        return fn

    return {name: make(name) for name in work_s}


def test_measuring_checks_results_drops_the_far_slower_and_caches(tmp_path):
    calls: dict[str, int] = {}
    built = []

    def setup():
        built.append(1)
        work = {"fast": 1e-5, "slow": 3e-4, "wrong": 1e-6}  # seconds of work per row
        return _fake(work, calls, wrong="wrong"), lambda m: torch.ones(m, 4), lambda x: x

    names = ["fast", "slow", "wrong"]
    quiet = dict(cache_dir=tmp_path, overrides="", is_busy=lambda: False)  # whatever else runs beside the test
    first = Dispatcher(**quiet).choose("op", "k", names, setup, (1, 8, 64), tol=1e-3)
    assert first.how == "measured" and first.names() == ["fast"] and len(built) == 1
    assert "off by" in first.rejected["wrong"] and "slower than the fastest at 1 rows" in first.rejected["slow"]
    assert set(first.times_ms) == {"fast"} and calls["slow"] <= 9  # checked, warmed, timed at 1 row only
    again = Dispatcher(**quiet).choose("op", "k", names, lambda: pytest.fail("measured again"), (1, 8, 64))
    assert again.how == "cached" and again.by_rows == first.by_rows and again.rejected == first.rejected
    other = Dispatcher(**quiet).choose("op", "other shape", ["fast"], setup_one(), (1,))
    assert other.how == "measured"


def test_timings_taken_on_busy_cpus_are_used_but_not_cached(tmp_path, caplog):
    busy = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: True)
    with caplog.at_level(logging.WARNING, logger="prefixserve"):
        first = busy.choose("op", "k", ["fast"], setup_one(), (1,))
    assert first.how == "measured" and "oversubscribed" in caplog.text
    again = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False).choose("op", "k", ["fast"],
                                                                                       setup_one(), (1,))
    assert again.how == "measured"  # nothing was cached: the next start measures again


def test_timings_that_shrink_with_more_rows_are_used_but_not_cached(tmp_path, caplog):
    """More rows are more work: a candidate timed slower on 1 row than on 64 ran beside something else."""
    from kernels.cpu.dispatch import implausible

    seen = {"int4_vnni": {"1": 11.97, "8": 13.13, "64": 0.19, "512": 1.08}, "int4": {"1": 7.46, "512": 2.2}}
    assert implausible(seen).startswith("int4_vnni: rows 1 ")
    assert implausible({"a": {"1": 0.01, "8": 0.004}}) is None  # microseconds apart: timer noise
    assert implausible({"a": {"1": 0.1, "8": 0.5, "64": 3.0}}) is None
    d = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False)
    import kernels.cpu.dispatch as dispatch

    measured = dispatch.Choice("op", "k", ((dispatch.EVERY, "fast"),), times_ms={"fast": {"1": 5.0, "64": 0.3}})
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="prefixserve"):
        mp.setattr(d, "_measure", lambda *a, **k: measured)
        first = d.choose("op", "k", ["fast"], setup_one(), (1, 64))
    assert first is measured and "fewer rows" in caplog.text
    again = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False).choose("op", "k", ["fast"],
                                                                                       setup_one(), (1, 64))
    assert again.how == "measured"  # nothing was cached


def test_more_rows_far_slower_per_row_is_implausible_and_measured_once_more(tmp_path, caplog):
    """A Zen 5 running two test workers timed int4_vnni at 5.47 ms for 512 rows after 0.18 ms for 64 (1.77 ms
    alone): the op bound it for every row count at 2x the other layout's time there. Such timings are measured
    once more, and the second, plausible, is bound and cached."""
    import kernels.cpu.dispatch as dispatch
    from kernels.cpu.dispatch import implausible

    seen = {"int4_vnni": {"1": 0.0203, "8": 0.0326, "64": 0.176, "512": 5.467},
            "int4": {"1": 0.0228, "8": 0.055, "64": 0.337, "512": 2.663}}
    assert implausible(seen).startswith("int4_vnni: rows 512 5.47 ms > 2 x rows ")
    alone = {"int4_vnni": {"1": 0.0221, "8": 0.039, "64": 0.208, "512": 1.767},
             "int4": {"1": 0.0282, "8": 0.058, "64": 0.355, "512": 2.713}}
    assert implausible(alone) is None
    assert implausible({"a": {"64": 0.2, "512": 2.0}}) is None  # 1.25x per row: within the slack
    timings = iter([seen, alone])
    d = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="prefixserve"):
        mp.setattr(d, "_measure", lambda *a, **k: dispatch.Choice("op", "k", ((dispatch.EVERY, "int4_vnni"),),
                                                                   times_ms=next(timings)))
        bound = d.choose("op", "k", ["int4_vnni", "int4"], setup_one(), (1, 8, 64, 512))
    assert bound.times_ms is alone and bound.slowdown() <= 1.5 and not caplog.text
    again = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False).choose(
        "op", "k", ["int4_vnni", "int4"], lambda: pytest.fail("measured a cached choice"), (1, 8, 64, 512))
    assert again.how == "cached" and again.times_ms == alone


def setup_one():
    return lambda: ({"fast": lambda x: x}, lambda m: torch.ones(m, 4), lambda x: x)


def test_an_override_forces_a_choice_and_a_wrong_name_is_refused(tmp_path):
    d = Dispatcher(cache_dir=tmp_path, overrides="op=slow")
    c = d.choose("op", "k", ["fast", "slow"], lambda: pytest.fail("measured a forced op"), (1,))
    assert c.how == "forced" and c.name_for(1) == "slow" == c.name_for(10**6)
    with pytest.raises(ValueError, match="not one of"):
        Dispatcher(cache_dir=tmp_path, overrides="op=nope").choose("op", "k", ["fast"], setup_one(), (1,))
    with pytest.raises(ValueError, match="op=implementation"):
        Dispatcher(cache_dir=tmp_path, overrides="garbage")


def test_no_correct_implementation_is_an_error(tmp_path):
    d = Dispatcher(cache_dir=tmp_path, overrides="")
    with pytest.raises(RuntimeError, match="no implementation ran correctly"):
        d.choose("op", "k", ["wrong"], lambda: ({"wrong": lambda x: x + 1}, lambda m: torch.ones(m, 4), lambda x: x),
                 (1,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_ops_pack_in_the_forms_they_measured_and_compute_the_linear(tmp_path, dtype):
    from kernels.cpu.native import native_kernels
    from kernels.cpu.ops import cpu_ops

    if native_kernels() is None or not native_kernels().has_dtype(dtype):
        pytest.skip("no C kernels for this dtype here")
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    for attempt in range(3):  # a fresh measurement where another process's load skewed one (xdist's workers)
        d = Dispatcher(cache_dir=tmp_path / str(attempt), overrides="", is_busy=lambda: False)
        ops = cpu_ops(dtype, dispatch=d)
        packed = ops.pack_weight(w)
        choice = d.choices[f"linear:{dtype} 96x64"]
        assert choice.how == "measured"
        # Where oneDNN has no kernels for the dtype (bfloat16 without AVX512-BF16 / AMX), the GEMM form was
        # measured too (the weight widened to float32, or torch's emulated matmul)
        assert set(d.choices) <= {f"linear:{dtype} 96x64", f"gemm:{dtype} 96x64"}
        # bound within 1.5x of the fastest at every row count it measured
        if all(c.slowdown() < 1.5 for c in d.choices.values()):
            break
    else:
        pytest.fail(f"a bound choice 1.5x slower than the fastest, 3 times: {[c.times_ms for c in d.choices.values()]}")
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 64).to(dtype)
        torch.testing.assert_close(ops.linear(x, packed, b), F.linear(x, w, b), **tol)


def test_the_quantized_head_keeps_only_what_it_binds(tmp_path):
    """An int8 LM head: the logits kernel per row count is measured, forms it does not bind are not kept, and
    the logits match the float32 product of its rows where greedy choices are made (the refined top)."""
    from kernels.quant_linear import dequantize, int8_from_float, quantized_logits, with_logits_kernels

    torch.manual_seed(0)
    qw = int8_from_float(torch.randn(512, 64))
    d = Dispatcher(cache_dir=tmp_path, overrides="")
    head = with_logits_kernels(qw, d)
    kernels = {name for _, name in head.logits_spans}
    assert kernels and (head.dense is not None) == ("bf16" in kernels)
    assert (head.onednn is not None) == ("onednn_int8" in kernels)
    assert (head.vnni is not None) == ("int8_vnni" in kernels)
    assert d.choices["lm_head:int8 512x64"].slowdown() < 1.5
    for rows in (1, 9, 64):
        x = torch.randn(rows, 64)
        logits, exact = quantized_logits(x, head), x @ dequantize(qw).t()
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))
        torch.testing.assert_close(logits, exact, atol=0.05 * exact.abs().max().item(), rtol=0)


def test_forced_int8pack_head_binds_no_second_table(tmp_path):
    from kernels.quant_linear import int8_from_float, with_logits_kernels

    head = with_logits_kernels(int8_from_float(torch.randn(256, 32)), Dispatcher(cache_dir=tmp_path,
                                                                                 overrides="lm_head=int8pack"))
    assert head.logits_spans == ((EVERY, "int8pack"),) and head.dense is None and head.onednn is None and head.vnni is None


def test_a_second_copy_is_kept_where_it_pays_and_then_used_wherever_fastest():
    """worth_their_memory: the bfloat16 head (a second copy) is kept only if somewhere it is at least its gain
    faster than the int8 table; once kept, every row count takes the fastest (not int8 where bf16 is 1.27x)."""
    from kernels.cpu.choices import worth_their_memory
    from kernels.cpu.dispatch import Choice

    def choice(bf16_ms):
        times = {"int8pack": {"1": 2.05, "8": 9.0, "64": 46.3}, "bf16": dict(zip(("1", "8", "64"), bf16_ms))}
        by_rows = tuple((int(r), min(times, key=lambda n: times[n][r])) for r in ("1", "8", "64"))
        return Choice("lm_head", "k", by_rows[:-1] + ((EVERY, by_rows[-1][1]),), times)

    assert worth_their_memory(choice((1.61, 2.0, 9.87)), {"bf16": 1.5}) == ((EVERY, "bf16"),)
    # nowhere 1.5x faster: the copy is not kept, int8 everywhere
    assert worth_their_memory(choice((1.61, 7.0, 40.0)), {"bf16": 1.5}) == ((EVERY, "int8pack"),)
    # kept for 64 rows; 8 rows stay int8 where int8 is faster
    assert worth_their_memory(choice((1.61, 9.5, 9.87)), {"bf16": 1.5}) == ((1, "bf16"), (8, "int8pack"), (EVERY, "bf16"))
    # two copies: one at most, the one fastest over the row counts (the 8-bit tiles here; the bfloat16 table is
    # 7% faster at 64 rows only), even where both pay their gain over the int8 kernel
    times = {"int8pack": {"1": 2.03, "8": 6.17, "64": 46.3}, "int8_vnni": {"1": 1.23, "8": 1.45, "64": 10.6},
             "bf16": {"1": 1.61, "8": 2.0, "64": 9.87}}
    two = Choice("lm_head", "k", ((1, "int8_vnni"), (8, "int8_vnni"), (EVERY, "bf16")), times)
    assert worth_their_memory(two, {"int8_vnni": 1.5, "bf16": 1.5}) == ((EVERY, "int8_vnni"),)
    assert worth_their_memory(two, {"bf16": 1.5, "int8_vnni": 1.5}) == ((EVERY, "int8_vnni"),)
    amx = Choice("lm_head", "k", ((EVERY, "bf16"),), {**times, "bf16": {"1": 0.9, "8": 1.0, "64": 2.0}})
    assert worth_their_memory(amx, {"int8_vnni": 1.5, "bf16": 1.5}) == ((EVERY, "bf16"),)


def test_onednns_prepacked_int8_head_is_charged_as_a_second_copy(monkeypatch, tmp_path):
    """oneDNN's int8 logits run on a prepacked copy of the table (qlinear_prepack), as the 8-bit tiles do: it is
    bound only where it pays HEAD_COPY_GAIN, and never beside another copy. Measured 1.2x faster than torch's int8
    kernel at every row count (below the gain), the head keeps no prepacked table."""
    from kernels.cpu.dispatch import Choice
    from kernels.quant_linear import int8_from_float, with_logits_kernels, with_onednn_int8

    times = {"int8pack": {"1": 1.2, "8": 6.0, "64": 48.0}, "onednn_int8": {"1": 1.0, "8": 5.0, "64": 40.0}}
    fake = Choice("lm_head", "int8 256x32", ((EVERY, "onednn_int8"),), times)
    monkeypatch.setattr(Dispatcher, "choose", lambda self, *a, **k: fake)
    head = with_logits_kernels(int8_from_float(torch.randn(256, 32)), Dispatcher(cache_dir=tmp_path, overrides=""))
    assert head.logits_spans == ((EVERY, "int8pack"),) and head.onednn is None
    # 2x faster somewhere: worth its copy, and then bound
    fast = Choice("lm_head", "int8 256x32", ((EVERY, "onednn_int8"),),
                  {**times, "onednn_int8": {"1": 0.6, "8": 5.0, "64": 40.0}})
    monkeypatch.setattr(Dispatcher, "choose", lambda self, *a, **k: fast)
    qw = int8_from_float(torch.randn(256, 32))
    head = with_logits_kernels(qw, Dispatcher(cache_dir=tmp_path, overrides=""))
    assert head.logits_spans == ((EVERY, "onednn_int8"),)
    assert (head.onednn is not None) == (with_onednn_int8(qw, probe=True).onednn is not None)


def test_a_per_row_step_measured_twice_alike_is_kept(tmp_path, caplog):
    """More rows far slower per row, twice within 1.5x: a candidate of two kernels (the bfloat16 LM head on an
    AVX2-only Zen 3: the row kernel at 4 rows, a GEMM on the table widened per call at 32), bound and cached.
    Fewer rows slower than more stays interference however often it is seen."""
    import kernels.cpu.dispatch as dispatch
    from kernels.cpu.dispatch import implausible, reproduced_per_row_step

    first = {"bf16": {"1": 1.4, "4": 4.98, "32": 91.4}, "int8_vnni": {"1": 2.1, "4": 2.6, "32": 9.0}}
    second = {"bf16": {"1": 1.5, "4": 5.2, "32": 88.0}, "int8_vnni": {"1": 2.0, "4": 2.7, "32": 9.3}}
    assert implausible(first).startswith("bf16: rows 32 91.4 ms > 2 x rows ")
    assert reproduced_per_row_step(first, second)
    assert not reproduced_per_row_step(first, {**second, "bf16": {"1": 1.5, "4": 5.2, "32": 150.0}})  # not alike
    shrinking = {"a": {"1": 5.0, "64": 0.3}}
    assert not reproduced_per_row_step(shrinking, shrinking)
    timings = iter([first, second])
    d = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="prefixserve"):
        mp.setattr(d, "_measure", lambda *a, **k: dispatch.Choice("op", "k", ((dispatch.EVERY, "int8_vnni"),),
                                                                   times_ms=next(timings)))
        bound = d.choose("op", "k", ["bf16", "int8_vnni"], setup_one(), (1, 4, 32))
    assert bound.times_ms is second and not caplog.text
    again = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False).choose(
        "op", "k", ["bf16", "int8_vnni"], lambda: pytest.fail("measured a cached choice"), (1, 4, 32))
    assert again.how == "cached" and again.times_ms == second


def test_run_queue_waits_are_counted_when_other_processes_hold_the_cpus():
    """waited_ns is the time our threads were ready but not running: another program's load shows in it at once,
    where the load average (a minute's mean) lags."""
    import subprocess
    import sys

    from kernels.cpu.dispatch import interfered, interference_mark, waited_ns

    if waited_ns() is None:
        pytest.skip("the kernel reports no run-queue waits here")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        time.sleep(0.2)
        mark = interference_mark()
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
        share = interfered(mark)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert share is not None and share > 0.1


def test_timings_taken_while_this_process_waited_for_a_cpu_are_measured_again_then_not_cached(tmp_path, caplog,
                                                                                             monkeypatch):
    """A compile on both cores of a 2-core Xeon made int4_vnni 12.1 ms a call where it takes 0.05: the load
    average stayed under the busy line and the choice was cached for good. Run-queue waits now decide."""
    import kernels.cpu.dispatch as dispatch

    monkeypatch.setattr(dispatch, "busy", lambda: False)
    waits = iter([0.9, 0.8])
    monkeypatch.setattr(dispatch, "interfered", lambda mark, share=dispatch.INTERFERENCE: next(waits))
    d = Dispatcher(cache_dir=tmp_path, overrides="")  # the default judge: load average and run-queue waits
    calls: list[int] = []
    real = d._measure
    monkeypatch.setattr(d, "_measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="prefixserve"):
        first = d.choose("op", "k", ["fast"], setup_one(), (1,))
    assert first.how == "measured" and len(calls) == 2 and "waited for a CPU 80%" in caplog.text
    assert not list(tmp_path.glob("op-*.json"))  # not cached
    monkeypatch.setattr(dispatch, "interfered", lambda mark, share=dispatch.INTERFERENCE: None)
    quiet = Dispatcher(cache_dir=tmp_path, overrides="").choose("op", "k", ["fast"], setup_one(), (1,))
    assert quiet.how == "measured" and list(tmp_path.glob("op-*.json"))
    assert Dispatcher(cache_dir=tmp_path, overrides="").choose("op", "k", ["fast"], setup_one(), (1,)).how == "cached"
