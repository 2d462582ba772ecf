"""engine.host_malloc: glibc keeps multi-MiB activations' pages between steps instead of handing
them back to the kernel and faulting them in again."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from engine.host_malloc import _user_chose_allocator, tune_host_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings are Linux-only")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Rounds of a forward pass's shape: four 24 MiB activations live at once, then freed; and, as a
# control that the count sees refaults at all, rounds of one 48 MiB block (above the 32 MiB mmap
# threshold: a fresh mapping every time, tuned or not). Untuned glibc trims the freed heap top and
# refaults it or not depending on what else sits on the heap (seen: 0 or 490k faults with one
# environment variable more or less), so only the tuned process's counts are asserted. Run in a
# fresh interpreter so this process's own allocations don't matter.
ROUNDS = textwrap.dedent("""
    import resource, sys
    import torch
    from engine.host_malloc import tune_host_malloc
    print(tune_host_malloc() if sys.argv[1] == "tuned" else None)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def rounds(numel, count):
        for _ in range(3):
            xs = [torch.ones(numel) for _ in range(count)]
        before = faults()
        for _ in range(20):
            xs = [torch.ones(numel) for _ in range(count)]
            del xs
        return faults() - before
    control = rounds(12 << 20, 1)  # first: later, a kept 96 MiB heap top would serve it without faults
    print(rounds(6 << 20, 4), control)
""")


def _page_faults(mode: str, env: dict) -> tuple[str, int, int]:
    """(whether tuning applied, minor faults over 20 activation rounds, over 20 control rounds)."""
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True,
                         env=env, cwd=ROOT)
    applied, activations, control = out.stdout.split()
    return applied, int(activations), int(control)


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")}


def test_tuned_malloc_stops_refaulting_freed_activations():
    applied, activations, control = _page_faults("tuned", _clean_env())
    assert applied == "True"
    # 20 x 48 MiB of fresh mappings: ~245k faults with 4 KiB pages, fewer with huge pages.
    assert control > 5000, control
    # 20 x 96 MiB of activations: the heap keeps their pages (a refault would be ~24k per round).
    assert activations < control / 50, (activations, control)


def test_tuning_is_idempotent():
    assert tune_host_malloc() == tune_host_malloc()


@pytest.mark.parametrize("env", [
    {"MALLOC_MMAP_THRESHOLD_": "131072"},
    {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
    {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
])
def test_users_own_allocator_settings_are_kept(env):
    assert _user_chose_allocator(env)


@pytest.mark.parametrize("env", [{}, {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, {"LD_PRELOAD": "libfoo.so"}])
def test_unrelated_settings_do_not_opt_out(env):
    assert not _user_chose_allocator(env)


def test_opted_out_process_is_left_alone():
    env = _clean_env() | {"MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
    applied, _, _ = _page_faults("tuned", env)
    assert applied == "False"


# Eight live threads allocate 24 MiB (1 MiB blocks, under the mmap threshold) one after another, each
# freeing it before the next starts. With an arena per thread each keeps its pages (the trim threshold
# keeps freed heap); with two arenas they reuse the same pages.
THREADS = textwrap.dedent("""
    import ctypes, sys, threading
    from engine.host_malloc import M_ARENA_MAX, _glibc, tune_host_malloc
    print(tune_host_malloc())
    if sys.argv[1] == "uncapped":
        _glibc().mallopt(M_ARENA_MAX, 64)
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    turns = [threading.Event() for _ in range(9)]
    done = threading.Event()
    def work(i):
        turns[i].wait()
        blocks = [bytearray(1 << 20) for _ in range(24)]
        del blocks
        turns[i + 1].set()
        done.wait()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    before = rss()
    turns[0].set()
    turns[8].wait()
    print((rss() - before) >> 20)
    done.set()
""")


def _thread_growth_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", THREADS, mode], capture_output=True, text=True, check=True,
                         env=_clean_env(), cwd=ROOT)
    applied, growth = out.stdout.split()
    assert applied == "True"
    return int(growth)


def test_threads_share_two_arenas_so_rss_keeps_one_high_water_mark():
    uncapped, capped = _thread_growth_mib("uncapped"), _thread_growth_mib("capped")
    assert uncapped > 4 * 24, uncapped  # the control: an arena per thread, each keeping its 24 MiB
    assert capped < 3 * 24, (capped, uncapped)
