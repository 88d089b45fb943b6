"""The README's Python snippets run as written, on a tiny random model instead of the embedded
one (the only substitution: the model name "default" becomes the tiny model's directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    """The ```python fenced blocks of a markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    # Byte-level prompts of the built-in GSM8K problems need more than the default 512 positions.
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"), max_position_embeddings=2048)


def test_readme_python_snippets_run(tiny_dir, tmp_path, monkeypatch, capsys):
    from evals.run import engines

    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 2 and any("use_policy" in b for b in blocks) \
        and any("run_eval" in b for b in blocks)
    monkeypatch.chdir(tmp_path)  # relative out= paths land in the test's directory
    (tmp_path / "evals").symlink_to(ROOT / "evals")  # the built-in data files the snippets read
    monkeypatch.setattr(engines, "ENGINES", {})  # no engine from another test is reused
    for block in blocks:
        assert '"default"' in block, block  # every snippet names its model, so it is substituted
        if "run_eval(" in block:  # grading workers import a script's main module: the guard
            head, guarded = block.split('\nif __name__ == "__main__":\n', 1)
            assert "run_eval(" not in head and all(
                line.startswith("    ") for line in guarded.splitlines() if line.strip()), block
        exec(compile(block.replace('"default"', repr(str(tiny_dir))), "README.md", "exec"),
             {"__name__": "__main__"})
    printed = capsys.readouterr().out
    for policy in ("full", "snapkv", "zipage"):
        assert f"{policy}: compress events" in printed
    full, compressed = printed.split("snapkv:", 1)
    assert "full: compress events 0" in full  # FullKV never compresses, the budgets do
    assert re.findall(r"(?:snapkv|zipage): compress events [1-9]", compressed) != []
    assert "compress events 0" not in compressed.split("pass@1")[0]
    assert "pass@1" in printed and "fid_agreement" in printed
