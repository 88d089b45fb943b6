"""`kvarena bench peer` without vLLM: a fake `vllm` package (tests/fixtures/fake_vllm, greedy
transformers on the same tiny model) behind an interpreter wrapper at the --peer-python interface
drives the real driver (evals/benchmarks/peer_vllm.py) and harness end to end; bad interpreters
are one-line errors. Not timing tests: only structure, token plumbing and consistency."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from engine.threads import applied_defaults
from evals.benchmarks import peer, peer_vllm, throughput
from peer_venv import wrapper
from tiny_models import make_tiny_llama_dir

REPO = Path(__file__).resolve().parents[1]
FAKE_VLLM = Path(__file__).parent / "fixtures" / "fake_vllm"
SCALE = replace(throughput.QUICK, repeats=2, uniform_requests=2, mixed_requests=3,
                mixed_tokens=(2, 6))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("peer"), name="tiny-peer"))


@pytest.fixture
def fake_peer(tmp_path):
    return wrapper(tmp_path, "fake-python", [FAKE_VLLM, REPO])


def test_bad_interpreters_are_one_line_errors(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    not_python = tmp_path / "not-python"
    not_python.write_text("#!/bin/sh\nexit 1\n")
    not_python.chmod(0o755)
    no_vllm = wrapper(tmp_path, "plain-python", [REPO])
    cases = [(str(tmp_path / "missing" / "python"), "no such file"),
             (no_vllm, "cannot import vllm"),
             (str(not_python), "did not run as a Python interpreter (exit 1)")]
    for python, message in cases:
        with pytest.raises(peer.PeerError, match=message.replace("(", r"\(").replace(")", r"\)")):
            peer.check_peer_python(python)
        out = CliRunner().invoke(app, ["bench", "peer", "--peer-python", python, "--quick",
                                       "--threads", "1", "--out-dir", str(tmp_path)])
        assert out.exit_code == 2, out.output
        lines = out.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], out.output
    assert not list(tmp_path.glob("peer*.json"))


@pytest.mark.parametrize("args, message", [(["--contend", "-1"], "--contend must be >= 0"),
                                           (["--peer-bind", "all"], "--peer-bind must be one of"),
                                           (["--repeats", "0"], "repeats must be >= 1")])
def test_cli_rejects_bad_settings_before_starting_anything(fake_peer, args, message):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "peer", "--peer-python", fake_peer, *args])
    assert out.exit_code == 2 and message in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1


def test_bind_list_and_targets():
    allowed = sorted(os.sched_getaffinity(0))
    assert peer_vllm.bind_list(1) == str(allowed[0])
    with pytest.raises(ValueError, match="exceeds"):
        peer_vllm.bind_list(len(allowed) + 1)
    quiet = peer.PeerSettings("python")
    assert peer.target_for("uniform", quiet) == 1.15 and peer.target_for("batch 1", quiet) == 1.1
    assert peer.target_for("heterogeneous", quiet) is None
    assert peer.target_for("uniform", replace(quiet, compile=False)) is None
    assert peer.target_for("uniform", replace(quiet, contend=1, compile=False)) == 0.8
    assert peer.target_for("uniform", replace(quiet, contend=2)) is None


def test_tree_cpu_seconds_counts_children():
    """A child that burns 0.3 s of CPU and then blocks shows in its parent's tree total."""
    burn = ("import sys, time\nwhile time.process_time() < 0.3: pass\n"
            "print('done', flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "done\n"
        own = peer_vllm.tree_cpu_seconds(os.getpid()) - peer_vllm.tree_cpu_seconds(child.pid)
        assert peer_vllm.tree_cpu_seconds(child.pid) >= 0.29
        assert own > 0 and peer_vllm.tree_cpu_seconds(os.getpid()) >= own + 0.29
    finally:
        child.stdin.close()
        child.wait()
    assert peer_vllm.tree_cpu_seconds(child.pid) == 0.0


def test_peer_bench_end_to_end_with_a_fake_vllm(tiny_model, fake_peer):
    lines: list[str] = []
    settings = peer.PeerSettings(fake_peer, compile=False, contend=1)
    result = peer.run_peer(tiny_model, peer=settings, scale=SCALE, log=lines.append)
    assert result.name == "peer-contend1"
    sides, ratios, repeats = (result.table(n) for n in ("sides", "ratios", "repeats"))
    assert [r["workload"] for r in ratios.rows] == list(throughput.WORKLOADS)
    assert [(r["workload"], r["side"]) for r in sides.rows] == [
        (w, s) for w in throughput.WORKLOADS for s in ("kvarena FullKV", "vLLM CPU eager")]
    # Greedy transformers behind the fake and kvarena on the same weights: identical tokens,
    # which checks prompts, order and token counts through the subprocess protocol.
    assert all(r["agreement"] == 1.0 for r in ratios.rows)
    for r in ratios.rows:
        ours, theirs = [s for s in sides.rows if s["workload"] == r["workload"]]
        assert ours["useful_tokens"] == theirs["useful_tokens"]
        assert r["ratio"] == pytest.approx(r["kvarena_tps"] / r["vllm_tps"])
        assert r["kvarena_tps"] == pytest.approx(ours["useful_tokens"] / ours["wall_s"])
    expected = {"batch 1": SCALE.single_tokens,
                "uniform": SCALE.uniform_requests * SCALE.uniform_tokens}
    assert {s["workload"]: s["useful_tokens"] for s in sides.rows
            if s["workload"] in expected} == expected
    assert [(r["workload"], r["repeat"], r["first"]) for r in repeats.rows] == [
        (w, i, first) for w in throughput.WORKLOADS for i, first in ((1, "kvarena"), (2, "vLLM"))]
    assert all(r["kvarena_load"] and r["vllm_load"] and r["vllm_idle_cpu_s"] >= 0
               for r in repeats.rows)
    # Only the contended quiet-machine-free target applies (uniform, one competitor).
    assert [(t.description, t.threshold) for t in result.targets] == [
        ("uniform: kvarena TPS / vLLM CPU eager TPS", 0.8)]
    # The driver's own process (the fake runs in it) is described from /proc.
    assert "0.0-fake" in result.notes[0] and "threads per CPU set" in result.notes[0]
    # The peer runs with its own OpenMP defaults, not the ones kvarena set for itself.
    for key in applied_defaults():
        assert key not in result.notes[0]
    # The competitor was started, named, and stopped.
    (started,) = [line for line in lines if "CPU-bound competitor" in line]
    pid = int(started.rsplit(" ", 1)[1])
    assert not Path(f"/proc/{pid}").exists()


def test_cli_writes_peer_markdown(tiny_model, fake_peer, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "peer", "--peer-python", fake_peer, "--quick",
                                   "--model", tiny_model, "--threads", "1", "--peer-eager",
                                   "--workloads", "batch 1", "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    payload = json.loads((tmp_path / "peer-quick.json").read_text())
    assert payload["name"] == "peer" and payload["scale"]["peer_mode"] == "eager"
    assert [t["name"] for t in payload["tables"]] == ["sides", "ratios", "repeats"]
    md = (tmp_path / "peer-quick.md").read_text()
    assert "kvarena bench peer --peer-python" in md and "| workload | kvarena tok/s |" in md


def test_driver_failure_reports_its_log(tiny_model, fake_peer, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "start")
    with pytest.raises(peer.PeerError, match="fake start failure") as err:
        peer.run_peer(tiny_model, peer=peer.PeerSettings(fake_peer), scale=SCALE,
                      log=lambda _: None)
    assert "failing at start as asked" in str(err.value)
    # A failed run's log is kept for reading (and removed here).
    log = Path(re.search(r"its log (\S+):", str(err.value)).group(1))
    assert log.is_file()
    log.unlink()
