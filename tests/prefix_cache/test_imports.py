import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
before = set(sys.modules)
import prefix_cache
new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print(json.dumps(new))
"""


def test_prefix_cache_imports_only_stdlib_and_xxhash():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, check=True)
    new = set(json.loads(proc.stdout))
    for forbidden in ("torch", "numpy", "engine", "kernels", "app", "integrations", "transformers"):
        assert forbidden not in new
    foreign = new - set(sys.stdlib_module_names) - {"prefix_cache", "xxhash"}
    assert not foreign, f"prefix_cache pulled in non-stdlib modules: {sorted(foreign)}"
