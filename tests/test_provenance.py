"""Provenance records (evals.provenance): git state, portable command lines, comparison keys."""

import sys

from evals import provenance as P


def test_git_state_of_the_checkout():
    state = P.git_state()
    assert len(state["commit"]) == 40 and isinstance(state["dirty"], bool)
    assert (state["diff_sha256"] is None) == (not state["dirty"])


def test_command_line_has_no_machine_paths(monkeypatch):
    outside = "/some/machine/data/gsm8k/test.jsonl"
    inside = str(P.REPO_ROOT / "evals" / "data" / "gsm8k_mini.jsonl")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kvarena", "eval", "--data", outside, f"--out={inside}",
                                      "--policy-arg", "budget=64"])
    assert P.command_line() == ("kvarena eval --data .../test.jsonl "
                                "--out=evals/data/gsm8k_mini.jsonl --policy-arg budget=64")


def test_provenance_key_separates_code_and_machines():
    base = {"git": {"commit": "c" * 40, "dirty": True, "diff_sha256": "aaa", "code_diff_sha256": None},
            "machine": {"cpu": "X", "cpu_count": 2, "device": "cpu"}}
    readme_edit = {**base, "git": {**base["git"], "diff_sha256": "bbb"}}
    engine_edit = {**base, "git": {**base["git"], "code_diff_sha256": "ccc"}}
    other_machine = {**base, "machine": {**base["machine"], "cpu_count": 16}}
    key = P.provenance_key(base)
    assert P.provenance_key(readme_edit) == key  # only the code's changes split runs
    assert P.provenance_key(engine_edit) != key and P.provenance_key(other_machine) != key
    assert P.provenance_key(None) == ("unknown",)
    # Records made before the code fingerprint existed compare by the whole-tree one.
    old = {**base, "git": {"commit": "c" * 40, "dirty": True, "diff_sha256": "aaa"}}
    assert P.provenance_key(old)[1] == "aaa"
    assert P.describe_key(P.provenance_key(engine_edit)) == (
        "commit cccccccccc + uncommitted code changes (diff ccc); 2 x X; device cpu")
    # One CPU model name covers machines with different vector units: recorded, they split runs.
    isa = {**base, "machine": {**base["machine"], "cpu_isa": "AVX512"}}
    assert P.provenance_key(isa) != key and "2 x X (AVX512)" in P.describe_key(P.provenance_key(isa))
    assert P.machine()["cpu_isa"] not in ("", None)


def test_run_provenance_fields():
    prov = P.run_provenance()
    assert set(prov) == {"git", "versions", "machine", "command", "date_utc"}
    assert "code_diff_sha256" in prov["git"]
    assert set(prov["versions"]) == {"python", "torch", "transformers", "kvarena"}
    assert {"cpu", "cpu_count", "platform", "device", "memory"} <= set(prov["machine"])
