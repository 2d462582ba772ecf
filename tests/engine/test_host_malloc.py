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

# Four 12 MiB activations live at once, then freed, as in a forward pass: by default glibc trims
# the freed heap top (36+ MiB over its adapted 24 MiB trim threshold) and every round faults the
# pages back in. Run in a fresh interpreter so this process's earlier allocations don't matter.
ROOT = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = textwrap.dedent("""
    import resource, sys
    import torch
    from engine.host_malloc import tune_host_malloc
    print(tune_host_malloc() if sys.argv[1] == "tuned" else None)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def one_round():
        xs = [torch.ones(3 << 20) for _ in range(4)]
        del xs
    for _ in range(3):
        one_round()
    before = faults()
    for _ in range(20):
        one_round()
    print(faults() - before)
""")


def _page_faults(mode: str, env: dict) -> tuple[str, int]:
    """(whether tuning applied, minor page faults over 20 rounds) in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True,
                         env=env, cwd=ROOT)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")}


def test_tuned_malloc_stops_refaulting_freed_activations():
    applied, tuned = _page_faults("tuned", _clean_env())
    _, default = _page_faults("default", _clean_env())
    assert applied == "True"
    # 20 rounds x 48 MiB: the default refaults thousands of pages; tuned, the heap keeps them.
    assert default > 5000, default
    assert tuned < default / 20, (tuned, default)


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
    applied, _ = _page_faults("tuned", env)
    assert applied == "False"
