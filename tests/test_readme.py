"""The README holds as written: its commands are the Makefile's, its policy table is the registry,
and the files the docs point to exist. Every command of every doc block is checked against the
CLI, and every Python block run as a saved script, in tests/test_docs.py."""

from __future__ import annotations

import re

from doc_blocks import ROOT, blocks, commands

README = ROOT / "README.md"


def section(title: str) -> str:
    """The README's text under ``## title``, up to the next ``## `` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def makefile_recipe(target: str) -> list[str]:
    """The shell commands of a Makefile target, continuations joined, variables expanded the way
    the README spells them (`.venv/bin/kvarena`, `runs/main`)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    lines = [" ".join(line.split()) for line in recipe.replace("\\\n", " ").splitlines()]
    variables = {"$(BIN)": ".venv/bin", "$(MAIN_OUT)": "runs/main"}
    for key, value in variables.items():
        lines = [line.replace(key, value) for line in lines]
    assert all("$(" not in line for line in lines), lines
    return lines


def test_the_main_job_commands_are_the_makefiles():
    """What the README says `make run` runs is what the Makefile runs, option for option."""
    shown = [b for b in blocks(README) if b.lang == "bash" and "kvarena eval" in b.code]
    assert len(shown) == 1, "one block lists make run's commands"
    readme = [" ".join(argv) for argv in commands(shown[0].code)]
    assert readme == [" ".join(line.split()) for line in makefile_recipe("run")]


def test_the_two_commands_are_make_targets():
    first = next(b for b in blocks(README) if b.lang == "bash")
    assert [argv[:2] for argv in commands(first.code)] == [["make", "run"], ["make", "test"]]


def test_the_policy_table_is_the_registry():
    from engine.policies.base import policy_registry

    rows = re.findall(r"^\| `([\w-]+)` \| ([^|]+) \| ([^|]+) \|$", section("The policies"), re.M)
    names = [name for name, _, _ in rows]
    assert sorted(names) == sorted(policy_registry()) and len(names) == len(set(names))
    assert all(paper.strip() and keeps.strip() for _, paper, keeps in rows)


def test_the_readme_says_what_a_newcomer_needs():
    text = README.read_text(encoding="utf-8")
    for name in ("`engine`", "`evals`", "`analysis`", "`cli`"):  # the top-level names that clash
        assert name in text
    assert "venv of its own" in text and "SmolLM2-135M-Instruct" in text
    output = next(b for b in blocks(README) if b.lang == "text")
    assert "kept" in output.code  # the run summary's kept line (per-head slots kept against allocated)


def test_every_path_the_docs_name_exists():
    """Every file of this repository a doc names in backquotes exists: paths under a top-level
    folder, or under engine/ or evals/ as the architecture names them (`policies/base.py`),
    found from the root or the doc's own folder; the guides' files-to-write excepted."""
    from doc_blocks import WRITTEN_BY_READER, doc_files

    pattern = re.compile(r"`([\w.-]+(?:/[\w.+=-]+)+\.(?:md|py|sh|c|h|jsonl|html|toml))`")
    folders = {p.name: p.parent for p in [*ROOT.iterdir(), *(ROOT / "engine").iterdir(),
                                          *(ROOT / "evals").iterdir(), *(ROOT / "results").iterdir()]
               if p.is_dir() and not p.name.startswith((".", "_")) and p.name != "runs"}
    checked, missing = 0, []
    for doc in [*doc_files(), ROOT / "results" / "README.md"]:
        written = WRITTEN_BY_READER.get(doc.name, set())
        for path in pattern.findall(doc.read_text(encoding="utf-8")):
            top = path.split("/")[0]
            if top not in folders or path in written:
                continue
            checked += 1
            if not any((base / path).exists() for base in (ROOT, doc.parent, folders[top])):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == [] and checked > 30
