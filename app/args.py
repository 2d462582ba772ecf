"""EngineConfig <-> command-line flags, shared by the CLI (app/cli.py) and the server (app/server.py)."""
from __future__ import annotations

import argparse
import dataclasses

from engine.config import EngineConfig


ALIASES = {"tensor_parallel_size": ("-tp",)}  # vLLM's short forms


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag named like the LLM argument (--max-num-seqs ...)."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
            continue
        kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
        flags = [flag, *ALIASES.get(f.name, ())]
        parser.add_argument(*flags, dest=f.name, type=kind, default=None, help=f"(default: {f.default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in values.items() if v is not None})
