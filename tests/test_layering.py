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
                 "engine.sampling_params", "engine.structured_output", "engine.tool_calls", "engine.llm",
                 "engine.openai_compat", "engine.frontend", "engine.collect_env"}
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


# Engine internals a front-end must never touch, however it got hold of them.
# ("runner" is not listed: the LangChain backend has runners of its own; an engine's runner is
# still caught below, as a non-public attribute of an engine holder.)
ENGINE_INTERNALS = {"detokenizer", "model_config", "blocks", "scheduler", "tiers", "_core", "kv_cache"}
# Names under which app/ and integrations/ hold an engine (AsyncEngine or LLM).
ENGINE_HOLDERS = {"engine", "_engine", "llm", "_llm"}


def _engine_public_names() -> set[str]:
    from engine import LLM, AsyncEngine

    return {n for cls in (AsyncEngine, LLM) for n in dir(cls) if not n.startswith("_")}


def _reach_through(path: pathlib.Path, public: set[str]) -> list[str]:
    """Attribute accesses that reach past the front-end surface: an engine internal by name, or any
    attribute of an engine holder (`x.engine.<attr>`, `llm.<attr>`) that is not public API."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        held = (isinstance(base, ast.Name) and base.id in ENGINE_HOLDERS) or (
            isinstance(base, ast.Attribute) and base.attr in ENGINE_HOLDERS)
        if node.attr in ENGINE_INTERNALS or (held and node.attr not in public):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("package", ["app", "integrations"])
def test_app_and_integrations_do_not_reach_through_the_engine_at_run_time(package):
    """Imports can be clean while code still walks `engine.engine.tokenizer`: every attribute taken
    from an engine must be public API of AsyncEngine / LLM (engine/frontend.py)."""
    public = _engine_public_names()
    bad = [hit for path in sorted((ROOT / package).rglob("*.py")) for hit in _reach_through(path, public)]
    assert not bad, bad


def test_reach_through_check_catches_the_old_patterns(tmp_path):
    public = _engine_public_names()
    sample = ROOT / "app" / "_reach_through_sample.py"
    try:
        sample.write_text("def f(engine, state):\n    a = engine.engine.tokenizer\n"
                          "    b = state.engine.engine.config.model\n    c = engine.model_info.max_model_len\n"
                          "    d = x.blocks.num_blocks\n")
        hits = _reach_through(sample, public)
    finally:
        sample.unlink()
    assert sorted(h.split(": ")[1] for h in hits) == [".blocks", ".config", ".engine", ".engine", ".tokenizer"]


def test_no_package_reaches_into_anothers_private_modules():
    bad = [f"{path}: imports {name}" for package in OURS for path, name in _modules(package)
           if _top(name) in OURS and _top(name) != package and any(p.startswith("_") for p in name.split(".")[1:])]
    assert not bad
