"""The command line documents itself: every flag of `prefixserve serve`, `generate`, `cluster` and
`collect-env` has a help line (more than its default), the engine flags sit in vLLM's groups, and every
EngineConfig field has one."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from app.args import GROUPS, HELP
from app.cli import build_parser
from engine.config import EngineConfig


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_engine_field_has_a_flag_with_help():
    assert set(HELP) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert {group for group, _ in HELP.values()} <= set(GROUPS)


@pytest.mark.parametrize("command", ["serve", "generate", "cluster", "collect-env"])
def test_every_flag_says_what_it_does(command):
    sub = _subparsers(build_parser())[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = (action.help or "").strip()
        assert text and not text.startswith("(default"), f"{command} {action.option_strings or action.dest}: {text!r}"
    rendered = sub.format_help()
    for action in sub._actions:  # what --help prints is what the parser defines
        for flag in action.option_strings:
            assert flag in rendered


def test_engine_flags_are_grouped_as_vllm_groups_them():
    rendered = _subparsers(build_parser())["serve"].format_help()
    for title in ("server:", "model:", "KV cache:", "scheduler:"):
        assert title in rendered
    section = rendered.split("scheduler:")[1]
    assert "--max-num-seqs" in section and "--max-num-batched-tokens" in section


def test_installed_script_imports_our_packages_from_outside_the_checkout(tmp_path):
    """`prefixserve` as installed (the console script, run outside the checkout, so the repo root is not on
    sys.path as it is under pytest): our top-level packages, not same-named ones in site-packages, must load
    (transformers 5.25 pulled Hugging Face's `kernels`, which shadowed kernels/ and broke `make serve`)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(sys.executable).parent / "prefixserve"
    if not script.exists():
        pytest.skip("no installed prefixserve script beside this interpreter")
    out = subprocess.run([str(script), "collect-env", "--json"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    assert json.loads(out.stdout)["c_kernels"]["loaded"] is True
