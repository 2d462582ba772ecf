"""The GPU check's steps (benchmarks/gpu/check.py runs each in its own process): the context they
share and the table of step functions. A step fills its result dict and saves it as it goes, so a step
killed at its time limit still reports what it finished."""
from __future__ import annotations

import gc
import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

CARRY = Path(__file__).resolve().parent / ".carry"  # git-ignored: what benchmarks/gpu/fetch_wheels.sh prepares


@dataclass(frozen=True)
class StepContext:
    """``work``: a folder the steps of one run share (model folders, each step's results/<name>.json);
    ``dry_run``: CPU, the Triton interpreter, tiny models."""

    work: Path
    dry_run: bool
    name: str

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def save(self, result: dict) -> dict:
        path = self.work / "results" / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str))
        tmp.replace(path)
        return result

    def env_result(self) -> dict:
        """What the env step measured (the GPU's floor figures); {} when it did not run."""
        path = self.work / "results" / "env.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def tokenizer_dir(self) -> Path:
        """SmolLM2's tokenizer files: carried to the GPU machine (fetch_wheels.sh copies them), or on a
        machine with the default model, its converted folder."""
        carried = CARRY / "smollm2-tokenizer"
        if (carried / "tokenizer.json").exists():
            return carried
        from engine.models.resolve import resolve_model

        return resolve_model("smollm2-135m-instruct")


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_named(name: str, work: Path, dry_run: bool) -> int:
    """Run step ``name``; its exit code: 0 when it ran and says ``ok`` (or says nothing of it)."""
    ctx = StepContext(work, dry_run, name)
    result: dict = {}
    try:
        STEP_FUNCTIONS[name](ctx, result)
    except BaseException as exc:  # said in check.json, not only in the log
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["ok"] = False
    ctx.save(result)
    return 0 if result.get("ok", True) else 1


def _env(ctx, result):
    from benchmarks.gpu.device_floor import env_step

    return env_step(ctx, result)


def _kernels(ctx, result):
    from benchmarks.gpu.kernel_tests import kernels_step

    return kernels_step(ctx, result)


def _parity(ctx, result):
    from benchmarks.gpu.parity import parity_step

    return parity_step(ctx, result)


def _workloads(shape):
    def step(ctx, result):
        from benchmarks.gpu.workloads import workloads_step

        return workloads_step(ctx, result, shape)

    return step


def _serve(ctx, result):
    from benchmarks.gpu.serve_check import serve_step

    return serve_step(ctx, result)


STEP_FUNCTIONS = {"env": _env, "kernels": _kernels, "parity": _parity, "llama-1b": _workloads("llama-1b"),
                  "llama-8b": _workloads("llama-8b"), "serve": _serve}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
