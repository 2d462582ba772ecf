"""The documentation site builds with MkDocs --strict (a broken link, a page missing from the nav or an
unknown anchor fails), and the README stays the short front page it is meant to be."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is a dev dependency (pyproject.toml): `make test` installs it")
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "kernels" / "index.html").exists()


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make serve" in text and "make test" in text
    for target in re.findall(r"\]\(([^)#]+)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
