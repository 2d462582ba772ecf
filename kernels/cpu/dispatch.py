"""Choosing among an op's implementations by measuring them here, at bind.

The CPU flags decide only which implementations are eligible (never an instruction the CPU lacks). Each
eligible one runs on inputs of the loaded model's own shapes at a few row counts, its output is checked
against the op's reference on the same inputs, and the fastest per row count is bound. Measured choices
are cached per machine (CPU model and flags, torch and oneDNN versions, the C kernels' build) and op shape
under ``~/.cache/prefixserve/dispatch/``, so later starts measure nothing. Why: a oneDNN int8 matmul
chosen by flags ran its reference kernel on an Intel VM (670 ms a call against 26 ms for torch's
int8 kernel) and nothing noticed; a flag says what a CPU can do, not what runs fast on it.

``PREFIXSERVE_KERNELS="op=impl,..."`` forces a choice (e.g. ``lm_head=int8pack``, ``linear=onednn``)
for debugging; the op names are those of ``Dispatcher.choices``.

    Dispatcher().choose(op, key, candidates, make_input, rows, reference) -> Choice
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("prefixserve")

OVERRIDE_ENV = "PREFIXSERVE_KERNELS"
FORMAT = 2  # bump when what a cached choice means changes (2: taken without run-queue waits; see interfered)
EVERY = 2**62  # "every larger row count" in a Choice's spans
TIE = 0.03  # within 3%, the earlier candidate (the cheaper one in memory, by the caller's order) is kept
DROP = 10.0  # a candidate this many times slower than the fastest at some row count is measured no further
SECOND_FORM_GAIN = 0.10  # "threshold" keeps two forms of a weight only where they save 10% over one
INTERFERENCE = 0.10  # this process's threads waiting for a CPU over 10% of a measurement's wall time: not kept


@dataclass(frozen=True)
class Choice:
    """What one op binds: ``by_rows`` ((up to rows, implementation), ...) ascending; a row count takes the
    entry of the smallest measured row count at or above it, and one above them all the last entry.
    ``times_ms``: {implementation: {rows: median ms}} as measured; ``rejected``: {implementation: why}."""

    op: str
    key: str
    by_rows: tuple[tuple[int, str], ...]
    times_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    how: str = "measured"  # "measured", "cached" or "forced"

    def name_for(self, rows: int) -> str:
        return next((name for upto, name in self.by_rows if rows <= upto), self.by_rows[-1][1])

    def names(self) -> list[str]:
        return list(dict.fromkeys(name for _, name in self.by_rows))

    def up_to(self, name: str) -> int:
        """The largest row count bound to ``name`` from 1 on (0 where the first span is another's; EVERY
        where it takes every row count)."""
        first_upto, first = self.by_rows[0]
        return 0 if first != name else first_upto

    def slowdown(self) -> float:
        """The bound choice's worst ratio to the fastest candidate measured, over the row counts (1.0: always
        the fastest)."""
        worst = 1.0
        for rows in {r for times in self.times_ms.values() for r in times}:
            bound = self.times_ms.get(self.name_for(int(rows)), {}).get(rows)
            best = min(t[rows] for t in self.times_ms.values() if rows in t)
            if bound is not None and best > 0:
                worst = max(worst, bound / best)
        return worst

    def spans(self) -> str:
        if len(self.by_rows) == 1:
            return f"{self.by_rows[0][1]} for every row count"
        out, low = [], 1
        for upto, name in self.by_rows:
            out.append(f"{name} for {low}-{upto if upto < EVERY else '...'} rows")
            low = upto + 1
        return ", ".join(out)

    def describe(self) -> str:
        rejected = "".join(f"; {k} rejected ({v})" for k, v in self.rejected.items())
        return f"{self.op} {self.key}: {self.spans()} ({self.how}){rejected}"


# What measuring needs: (candidates {name: fn(x) -> y}, make_input(rows) -> x, reference fn(x) -> y or None)
Setup = tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], Callable[[int], torch.Tensor],
              Callable[[torch.Tensor], torch.Tensor] | None]


class Dispatcher:
    """Measures, caches and remembers one process's choices (``choices``: op key -> Choice, for the start-up
    log and ``prefixserve collect-env``)."""

    def __init__(self, cache_dir: Path | None = None, overrides: str | None = None, budget_s: float = 0.25,
                 is_busy: Callable[[], bool] | None = None) -> None:
        # timings taken while other work held the CPUs are used but not cached; None: the load average and this
        # process's own run-queue waits (busy, interfered); tests inject a constant
        self.is_busy = is_busy
        self.cache_dir = cache_dir if cache_dir is not None else _default_cache_dir()
        self.overrides = _parse_overrides(os.environ.get(OVERRIDE_ENV, "") if overrides is None else overrides)
        self.budget_s = budget_s  # per candidate and row count, at most (a few calls suffice for a median)
        self.choices: dict[str, Choice] = {}

    def choose(self, op: str, key: str, names: list[str], setup: Callable[[], Setup], rows: tuple[int, ...],
               tol: float = 1e-2, mode: str = "per_row") -> Choice:
        """The implementation of ``op`` (at ``key``, its shape) to bind per row count, among ``names`` (in
        order of preference when they tie). ``setup()`` builds what measuring needs, only when there is no
        cached choice: (candidates {name: fn(x) -> y}, make_input(rows) -> x, reference fn(x) -> y); each
        candidate is checked against the reference on the same x (relative to its largest magnitude:
        ``tol``). ``mode``:
          "per_row"    the fastest at each measured row count;
          "single"     one for every row count (a weight layout): the best geometric mean of its ratios to
                       the fastest;
          "threshold"  two candidates, the first up to a row count and the second above it (a small-batch
                       kernel beside a GEMM): the split with the best geometric mean of ratios."""
        full_key = f"{op}:{key}"
        if full_key in self.choices:
            return self.choices[full_key]
        forced = self.overrides.get(op)
        if forced is not None:
            if forced not in names:
                raise ValueError(f"{OVERRIDE_ENV}: {op}={forced} is not one of {sorted(names)} here")
            choice = Choice(op, key, ((EVERY, forced),), how="forced")
        else:
            choice = self._cached(op, key, names)
            if choice is None:
                candidates, make_input, reference = setup()
                eligible = {n: candidates[n] for n in names if n in candidates}
                choice = self._measure_quietly(op, key, names, eligible, make_input, rows, reference, tol, mode)
        self.choices[full_key] = choice
        return choice

    def _measure_quietly(self, op, key, names, eligible, make_input, rows, reference, tol, mode) -> Choice:
        """Measured, and measured once more where other work took the CPUs meanwhile or the timings are ones more
        work cannot explain; cached only when an attempt was neither."""
        first, first_odd = None, None
        for _ in range(2):
            mark = interference_mark()
            choice = self._measure(op, key, eligible, make_input, rows, reference, tol, mode)
            taken = self._taken(mark)
            odd = None if taken else implausible(choice.times_ms)
            if odd and first_odd and reproduced_per_row_step(first.times_ms, choice.times_ms):
                logger.info("%s %s: %s, measured twice alike: a candidate whose form changes with the rows, kept",
                            op, key, odd)
                odd = None
            if not taken and not odd:
                self._store(choice, names)
                return choice
            first, first_odd = choice, odd
        if taken:
            logger.warning("%s %s measured while other work held the CPUs (%s), twice: used for this process only, "
                           "measured again at the next start", op, key, taken)
        else:
            logger.warning("%s %s: timings more work cannot explain, twice (%s; fewer rows slower than more, or more "
                           "rows far slower per row): measured under interference the load average missed; used for "
                           "this process only", op, key, odd)
        return choice

    def _taken(self, mark: tuple[int | None, float]) -> str | None:
        """Why timings taken since ``mark`` are not this machine's to keep, or None."""
        if self.is_busy is not None:
            return "oversubscribed, as told" if self.is_busy() else None
        return interference(mark)

    def summary(self) -> str:
        """One line for the start-up log: each op's choices, shapes with the same choice together."""
        groups: dict[tuple[str, str, str, str], list[str]] = {}
        for c in self.choices.values():
            rejected = ", ".join(f"{k} rejected: {v}" for k, v in c.rejected.items())
            groups.setdefault((c.op, c.spans(), c.how, rejected), []).append(c.key)
        parts = [f"{op} [{', '.join(keys)}]: {spans} ({how}{'; ' + rejected if rejected else ''})"
                 for (op, spans, how, rejected), keys in groups.items()]
        return "; ".join(parts) or "none"

    # -- measuring --------------------------------------------------------------------------------
    def _measure(self, op, key, candidates, make_input, rows, reference, tol, mode) -> Choice:
        names = list(candidates)
        rejected: dict[str, str] = {}
        x = make_input(min(rows))
        expected = reference(x).float() if reference is not None else None
        for name in names:
            try:
                y = candidates[name](x)
                if expected is not None:
                    err = (y.float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
                    if not math.isfinite(err) or err > tol:
                        rejected[name] = f"off by {err:.2g} of the largest output"
            except Exception as exc:  # an implementation that cannot run here is not eligible
                rejected[name] = f"{type(exc).__name__}: {exc}"[:200]
        eligible = [n for n in names if n not in rejected]
        if not eligible:
            raise RuntimeError(f"{op} {key}: no implementation ran correctly here: {rejected}")
        times: dict[str, dict[str, float]] = {n: {} for n in eligible}
        for m in rows:
            x = make_input(m)
            for name, ms in self._time(candidates, eligible, x).items():
                times[name][str(m)] = ms
            best = min(times[n][str(m)] for n in eligible)
            for name in [n for n in eligible if times[n][str(m)] > DROP * best]:
                # far behind (oneDNN's reference kernel ran 230x slower than torch's int8 kernel on a Zen 5):
                # not worth its calls at larger row counts, nor bound
                rejected[name] = f"{times[name][str(m)] / best:.0f}x slower than the fastest at {m} rows"
                eligible.remove(name)
                del times[name]
        if mode == "threshold" and len(eligible) == 2:
            by_rows = _threshold(eligible, times, rows)
        elif mode in ("single", "threshold"):
            by_rows = _single(eligible, times, rows)
        else:
            by_rows = _per_row(eligible, times, rows)
        return Choice(op, key, by_rows, times, rejected)

    def _time(self, candidates, names: list[str], x: torch.Tensor) -> dict[str, float]:
        """Least ms of each candidate's calls on x, the calls interleaved (a slow spell of this machine hits
        them alike), after a warm-up call each."""
        warm = {}
        for name in names:
            t0 = time.perf_counter()
            candidates[name](x)
            warm[name] = time.perf_counter() - t0
        # Far slower even warming up (oneDNN's first call builds its kernel, so only by a wide margin): one
        # more call is enough to say so
        slow = {n for n in names if warm[n] > 4 * DROP * min(warm.values())}
        samples: dict[str, list[float]] = {n: [] for n in names}
        spent = {n: 0.0 for n in names}
        for _ in range(7):
            for name in names:
                if (spent[name] > self.budget_s and len(samples[name]) >= 3) or (name in slow and samples[name]):
                    continue
                t0 = time.perf_counter()
                candidates[name](x)
                dt = time.perf_counter() - t0
                samples[name].append(dt)
                spent[name] += dt
        # The least of the samples: being descheduled only ever adds time (medians under another process's
        # load read as 8 ms a call for 8-microsecond kernels, time slices apart)
        return {n: min(s) * 1e3 for n, s in samples.items()}

    # -- the cache ----------------------------------------------------------------------------------
    def _path(self, op: str, key: str, names) -> Path:
        digest = hashlib.sha256(json.dumps([FORMAT, op, key, sorted(names), machine_fingerprint()]).encode())
        return self.cache_dir / f"{op}-{digest.hexdigest()[:20]}.json"

    def _cached(self, op: str, key: str, candidates) -> Choice | None:
        path = self._path(op, key, candidates)
        try:
            data = json.loads(path.read_text())
            choice = Choice(op, key, tuple((int(u), n) for u, n in data["by_rows"]), data.get("times_ms", {}),
                            data.get("rejected", {}), how="cached")
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return choice if all(n in candidates for n in choice.names()) else None

    def _store(self, choice: Choice, candidates) -> None:
        path = self._path(choice.op, choice.key, candidates)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**asdict(choice), "machine": machine_fingerprint()}, indent=1))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only home: measured again next start, nothing worse
            logger.debug("dispatch cache not written (%s)", exc)


def _per_row(names: list[str], times: dict[str, dict[str, float]], rows) -> tuple[tuple[int, str], ...]:
    picks = []
    for m in sorted(rows):
        best = min(times[n][str(m)] for n in names)
        picks.append((m, next(n for n in names if times[n][str(m)] <= best * (1 + TIE))))
    merged: list[tuple[int, str]] = []
    for m, name in picks:  # consecutive row counts with one choice collapse into one span
        if merged and merged[-1][1] == name:
            merged[-1] = (m, name)
        else:
            merged.append((m, name))
    merged[-1] = (EVERY, merged[-1][1])  # the last choice takes every larger row count
    return tuple(merged)


def _mean_ratio(pick: Callable[[int], str], names: list[str], times, rows) -> float:
    """Geometric mean over the row counts of the picked implementation's time over the fastest's."""
    ratios = [times[pick(m)][str(m)] / min(times[o][str(m)] for o in names) for m in rows]
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _single(names: list[str], times: dict[str, dict[str, float]], rows) -> tuple[tuple[int, str], ...]:
    cost = {n: _mean_ratio(lambda m, n=n: n, names, times, rows) for n in names}
    best = min(cost.values())
    return ((EVERY, next(n for n in names if cost[n] <= best * (1 + TIE))),)


def _threshold(names: list[str], times: dict[str, dict[str, float]], rows) -> tuple[tuple[int, str], ...]:
    small, large = names
    splits = [0, *sorted(rows)]  # small up to the split (0: never), large above it; the largest: small always
    cost = {t: _mean_ratio(lambda m, t=t: small if m <= t else large, names, times, rows) for t in splits}
    best = min(cost.values())
    t = next(t for t in reversed(splits) if cost[t] <= best * (1 + TIE))  # ties: the small kernel further
    whole = min((0, splits[-1]), key=lambda s: (cost[s], -s))
    if 0 < t < splits[-1] and cost[t] > cost[whole] * (1 - SECOND_FORM_GAIN):
        t = whole  # both forms are two copies of the weight: only for a clear gain
    if t == 0:
        return ((EVERY, large),)
    return ((EVERY, small),) if t == max(rows) else ((t, small), (EVERY, large))


def implausible(times_ms: dict[str, dict[str, float]], slack: float = 2.0, floor_ms: float = 0.05,
                per_row: bool = True) -> str | None:
    """Timings more work cannot explain, which were taken while something else ran: a candidate whose call
    on fewer rows took over ``slack`` x its call on more rows, or whose call on more rows took over ``slack`` x
    its time per row on fewer (every op measured here is a linear, whose cost per row only falls as rows
    grow; ``per_row`` False: only the first check); as "name: rows r1 t1 ms > rows r2 t2 ms" or "name: rows r2
    t2 ms > ...". None when neither happens (differences under ``floor_ms`` are timer noise). (An AMD EPYC Zen 4 under a saturated server
    beside the tests cached int4_vnni at 12 ms for 1 row against 0.19 ms for 64, which the load average had
    missed; a Zen 5 running two test workers timed it at 5.47 ms for 512 rows after 0.18 ms for 64, and 1.77
    ms alone.)"""
    for name, by_rows in times_ms.items():
        points = sorted((int(r), t) for r, t in by_rows.items())
        for i, (r1, t1) in enumerate(points):
            for r2, t2 in points[i + 1:]:
                if t1 > slack * t2 and t1 - t2 > floor_ms:
                    return f"{name}: rows {r1} {t1:.3g} ms > rows {r2} {t2:.3g} ms"
                at_r1 = t1 * r2 / r1  # rows r2 at rows r1's time per row
                if per_row and t2 > slack * at_r1 and t2 - at_r1 > floor_ms:
                    return f"{name}: rows {r2} {t2:.3g} ms > {slack:g} x rows {r1}'s {t1:.3g} ms per row"
    return None


def reproduced_per_row_step(first: dict[str, dict[str, float]], second: dict[str, dict[str, float]],
                            agree: float = 1.5) -> bool:
    """Two measurements whose only oddity is more rows far slower per row (never fewer rows slower than more),
    every time within ``agree`` x of the other's: not interference, which does not repeat itself, but a
    candidate made of two kernels (the bfloat16 LM head on an AVX2-only AMD EPYC Zen 3: the C row kernel at 4
    rows, 4.98 ms, then a GEMM on the table widened per call at 32, 91.4 ms, in both measurements; the same VM
    moved other timings of the two sets by up to 1.31x)."""
    if implausible(first, per_row=False) or implausible(second, per_row=False) or first.keys() != second.keys():
        return False
    for name, by_rows in first.items():
        if by_rows.keys() != second[name].keys():
            return False
        for r, t in by_rows.items():
            t2 = second[name][r]
            if max(t, t2) > agree * min(t, t2) and abs(t - t2) > 0.05:
                return False
    return True


def waited_ns() -> int | None:
    """Nanoseconds so far that this process's threads were ready to run but waited for a CPU (the scheduler's
    run-queue delay, /proc/self/task/*/schedstat), plus the time the hypervisor took from this VM's CPUs (steal,
    /proc/stat): what other programs took from ours. None where the kernel reports neither. Why: a compile on
    both cores of a 2-core Intel Xeon (family 6 model 167) made int4_vnni time 12.1 ms a call on 1 row of a
    960x576 weight (0.022 ms quiet), the load average did not pass the busy line, and the cached choice bound
    torch's int4 kernel for good: the default model's batch of 8 ran at 300-350 tokens/s instead of 430-470.
    Measured on that machine: a quiet 0.5 s spin waited 0.56 ms, beside two busy processes 250 ms."""
    total, seen = 0, False
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
                seen = True
            except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                continue
    except OSError:
        pass
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        if fields[0] == "cpu" and len(fields) > 8:
            total += int(fields[8]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
            seen = True
    except (OSError, ValueError, IndexError):
        pass
    return total if seen else None


def interference_mark() -> tuple[int | None, float]:
    """What :func:`interference` and :func:`interfered` measure from: (waited_ns(), time.perf_counter())."""
    return waited_ns(), time.perf_counter()


def interference(mark: tuple[int | None, float]) -> str | None:
    """Why timings taken since ``mark`` (:func:`interference_mark`) are not this machine's to keep (the load
    average, or this process's waits for a CPU), or None."""
    if busy():
        return f"oversubscribed: load {os.getloadavg()[0]:.1f} on {os.cpu_count() or 1} CPUs"
    share = interfered(mark)
    return f"this process waited for a CPU {share:.0%} of the time" if share is not None else None


def interfered(mark: tuple[int | None, float], share: float = INTERFERENCE) -> float | None:
    """The share of the wall time since ``mark`` (:func:`interference_mark`) that this process waited
    for a CPU, where over ``share``; None otherwise or where the kernel does not say."""
    before, t0 = mark
    now = waited_ns()
    wall = time.perf_counter() - t0
    if before is None or now is None or wall <= 0:
        return None
    waited = (now - before) / 1e9 / wall
    return waited if waited > share else None


def busy() -> bool:
    """Other work oversubscribes the CPUs (1-minute load average above 1.5 per CPU): timings taken now are not
    this machine's to keep."""
    try:
        return os.getloadavg()[0] > 1.5 * (os.cpu_count() or 1)
    except OSError:
        return False


def _parse_overrides(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        op, sep, impl = part.partition("=")
        if not sep or not op.strip() or not impl.strip():
            raise ValueError(f"{OVERRIDE_ENV} takes op=implementation[,op=implementation], got {text!r}")
        out[op.strip()] = impl.strip()
    return out


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixserve" / "dispatch"


@functools.cache  # once per process: it reads /proc/cpuinfo and asks torch
def machine_fingerprint() -> str:
    """What a measured choice depends on beside the op: CPU model and flags, what the OS grants (AMX),
    torch and oneDNN versions, the C kernels' build."""
    from .native import _cpu_flags, cpu_model_name, native_build_id, os_grants_amx

    return hashlib.sha256(json.dumps([
        cpu_model_name(), _cpu_flags(), os_grants_amx(), platform.machine(), torch.__version__, onednn_version(),
        native_build_id()]).encode()).hexdigest()[:16]


def onednn_version() -> str:
    """oneDNN's version in this torch build ("3.12.0"), from its build description."""
    m = re.search(r"MKL-DNN v([\w.]+)", torch.__config__.show())
    return m.group(1) if m else "none"
