"""Dependencies point one way (DEVELOPERS.md): app, integrations -> engine's public API;
engine -> prefix_cache, kernels; prefix_cache -> stdlib + xxhash (torch/redis only in its tier
code); kernels -> torch, triton. Checked on every import statement of every module, so a new
import that breaks the direction fails here, whether or not it runs at import time."""
import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"app", "integrations", "engine", "prefix_cache", "kernels"}
# The engine modules app/ and integrations/ may use: its public API, not its internals.
ENGINE_PUBLIC = {"engine", "engine.async_engine", "engine.config", "engine.errors", "engine.outputs",
                 "engine.sampling_params", "engine.structured_output", "engine.tool_calls", "engine.llm"}
PREFIX_CACHE_TIERS = {"redis_store.py"}  # the Redis tier: the only prefix_cache module with redis/torch


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute module names imported anywhere in the file (relative imports stay in the package)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            yield path.relative_to(ROOT), name


def _violations(package: str, allowed) -> list[str]:
    return [f"{path}: imports {name}" for path, name in _modules(package) if not allowed(path, name)]


def _top(name: str) -> str:
    return name.split(".")[0]


def test_kernels_import_only_torch_triton_and_the_stdlib():
    third_party = {"torch", "triton"}
    assert not _violations("kernels", lambda p, n: _top(n) in {"kernels"} | third_party
                           or _top(n) in sys.stdlib_module_names)


def test_prefix_cache_imports_only_stdlib_and_xxhash_outside_its_tier_code():
    def allowed(path, name):
        if _top(name) in {"prefix_cache", "xxhash"} or _top(name) in sys.stdlib_module_names:
            return True
        return path.name in PREFIX_CACHE_TIERS and _top(name) in {"torch", "redis"}

    assert not _violations("prefix_cache", allowed)


def test_engine_never_imports_the_layers_above_it():
    assert not _violations("engine", lambda p, n: _top(n) not in {"app", "integrations"})


@pytest.mark.parametrize("package", ["app", "integrations"])
def test_app_and_integrations_use_only_the_engines_public_api(package):
    def allowed(path, name):
        if _top(name) in {"kernels", "prefix_cache"}:
            return False
        if _top(name) == "engine":
            return name in ENGINE_PUBLIC
        return True

    assert not _violations(package, allowed)


def test_no_package_reaches_into_anothers_private_modules():
    bad = [f"{path}: imports {name}" for package in OURS for path, name in _modules(package)
           if _top(name) in OURS and _top(name) != package and any(p.startswith("_") for p in name.split(".")[1:])]
    assert not bad
