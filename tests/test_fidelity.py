"""Fidelity to FullKV (evals.run.fidelity) on a tiny random Llama (tests/tiny_models.py) with the GSM8K
fixture: the statistics, FullKV against itself, a budget larger than every sequence, drift at a
tiny budget, the reference cache (reuse across policies and on resume) and sampled decoding."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from evals import results as R
from evals.results.files import read_json
from evals.run import fidelity as F
from evals.run.runner import run_eval
from evals.run.settings import EvalHooks, EvalSettings
from tiny_models import make_tiny_llama_dir

DATA = Path(__file__).parent / "fixtures" / "data" / "gsm8k" / "test.jsonl"
# block 4, a 1024-token pool: a 24-token budget compresses every request many times.
ENGINE = dict(block_size=4, kv_cache_tokens=1024, max_tokens=40, limit=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


class Messages(EvalHooks):
    def __init__(self):
        self.messages = []

    def on_message(self, text):
        self.messages.append(text)


def run(model_dir, out, policy="full", hooks=None, **kw):
    base = dict(task="gsm8k", model=str(model_dir), data=str(DATA), out=str(out), policy=policy,
                temperature=0.0, **ENGINE)
    base.update(kw)
    return run_eval(EvalSettings(**base), hooks)


def samples(outcome) -> list[dict]:
    return [json.loads(x) for x in (outcome.path / R.SAMPLES_FILE).read_text().splitlines()]


def reference_lines(out: Path) -> list[dict]:
    files = list(Path(out).rglob(F.REFERENCE_FILE))
    assert len(files) == 1, files
    return [json.loads(x) for x in files[0].read_text().splitlines()]


# ------------------------------------------------------------------------------ statistics


def test_statistics_on_hand_made_sequences():
    assert F.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert F.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert F.first_divergence([1, 2], [1, 2, 3]) == 2          # the generation stopped early
    assert F.first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3    # ... or ran on
    assert F.agreement([1, 5, 3], [1, 2, 3]) == pytest.approx(2 / 3)
    assert F.agreement([1], [1, 2, 3, 4]) == 0.25              # missing positions disagree
    assert F.delta_nll([-1.0, -3.0], [-1.0, -1.0, -1.0]) == [0.0, 2.0]
    deltas = [0.0] * 40 + [1.0] * 32 + [0.0] * 10
    assert F.worst_window(deltas) == pytest.approx(1.0)
    assert F.worst_window([0.5, 1.5]) == pytest.approx(1.0)    # shorter than a window: the mean
    assert F.worst_window([]) is None
    ref = {"tokens": [4, 5, 6], "logprobs": [-0.5, -1.0, -2.0]}
    same = F.sample_fields(ref, [4, 5, 6], [-0.5, -1.0, -2.0])
    assert same == {"fid_delta_nll": 0.0, "fid_worst_window": 0.0, "fid_first_divergence": None,
                    "fid_agreement": 1.0, "fid_ref_tokens": 3}
    worse = F.sample_fields(ref, [4, 9], [-1.5, -1.0, -2.3])
    assert worse["fid_delta_nll"] == pytest.approx((1.0 + 0.0 + 0.3) / 3)
    assert worse["fid_first_divergence"] == 1 and worse["fid_agreement"] == pytest.approx(1 / 3)


def test_reference_key_changes_with_generation_settings():
    base = {"model": "m", "model_spec": "m", "task": "gsm8k", "task_options": {}, "data_source": "d",
            "max_tokens": 64, "temperature": 0.0, "seed": 0, "thinking": None}
    name = F.reference_key(base)[0]
    for change in ({"max_tokens": 65}, {"seed": 1}, {"temperature": 0.6}, {"thinking": True},
                   {"task_options": {"lengths": [256]}}, {"data_source": "e"}):
        assert F.reference_key({**base, **change})[0] != name, change
    # Settings that do not change FullKV's output (budget, block size) keep the key.
    assert F.reference_key({**base, "kv_budget": 32, "block_size": 8})[0] == name


# ------------------------------------------------------------------------------ end to end


def test_fullkv_against_itself_is_exactly_zero(model_dir, tmp_path):
    full = run(model_dir, tmp_path)
    rows = samples(full)
    assert rows and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["fid_delta_nll"] == 0.0 and r["fid_worst_window"] == 0.0
        assert r["fid_agreement"] == 1.0 and r["fid_first_divergence"] is None
        assert r["fid_ref_tokens"] == r["output_tokens"]
    # The run wrote the reference itself (no second pass): its entries are its outputs.
    refs = {(e["uid"], e["sample"]): e for e in reference_lines(tmp_path)}
    assert len(refs) == len(rows)
    passes = [json.loads(x) for x in (full.path / F.PASSES_FILE).read_text().splitlines()]
    assert passes[-1]["reference_requests"] == 0 and passes[-1]["forced_requests"] == 0
    assert full.metrics["fid_delta_nll"] == 0.0 and full.metrics["fid_agreement"] == 1.0


def test_fullkv_forced_pass_reproduces_the_reference(model_dir, tmp_path):
    """The forced-pass machinery itself: FullKV forced on its own reference gets the reference's
    log-likelihoods back (scored to the end, EOS included)."""
    from engine.llm import LLM
    from engine.models.loader import load_tokenizer
    from evals.run.plan import render_requests

    full = run(model_dir, tmp_path)
    config = read_json(full.path / R.CONFIG_FILE)
    fid = F.Fidelity(tmp_path, config, "full", {})
    fid.is_full = False  # run the forced pass a FullKV run skips by construction
    llm = LLM(str(model_dir), policy="full", block_size=4, kv_cache_tokens=1024)
    settings = EvalSettings(task="gsm8k", model=str(model_dir), data=str(DATA), limit=3)
    tokenizer = load_tokenizer(str(model_dir))
    todo = [(u, 0) for u in uids(full)]
    reqs = F.requests_for(render_requests(settings, full_plan(settings), todo, tokenizer,
                                          llm.runner.max_model_len, 0.0, 40))
    fid.forced_pass(llm, reqs)
    for q in reqs:
        ref = fid.reference.get(q.uid, q.sample, q.sha)
        forced = fid.forced[(q.uid, q.sample, q.sha)]
        assert len(forced) == len(ref["tokens"])
        assert max(abs(a - b) for a, b in zip(forced, ref["logprobs"])) < 1e-4


def uids(outcome) -> list[str]:
    return sorted({r["uid"] for r in samples(outcome)})


def full_plan(settings):
    from engine.models.loader import load_tokenizer
    from evals.run.plan import load_task, make_plan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixture's malformed rows (tested in test_eval_runner)
        problems = load_task(settings).load(settings.data, limit=settings.limit,
                                            tokenizer=load_tokenizer(settings.model))
    return make_plan(problems, 1)


def test_budget_above_every_sequence_equals_fullkv(model_dir, tmp_path):
    run(model_dir, tmp_path)
    big = run(model_dir, tmp_path, policy="snapkv", policy_args={"budget": 1024})
    rows = samples(big)
    assert all(r["events"].get("prefill_compress", 0) == 0 for r in rows)  # nothing compressed
    for r in rows:
        assert r["fid_agreement"] == 1.0 and r["fid_first_divergence"] is None
        assert abs(r["fid_delta_nll"]) < 1e-5 and abs(r["fid_worst_window"]) < 1e-5


def test_tiny_budget_drifts(model_dir, tmp_path):
    small = run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24})
    rows = samples(small)
    assert sum(r["events"].get("compress", 0) for r in rows) > 0
    assert small.metrics["fid_delta_nll"] > 0.01
    assert max(r["fid_worst_window"] for r in rows) >= max(r["fid_delta_nll"] for r in rows)
    assert small.metrics["fid_agreement"] < 1.0
    assert any(r["fid_first_divergence"] is not None for r in rows)


def test_reference_is_cached_and_reused(model_dir, tmp_path):
    from evals.run import engines

    engines.clear()
    hooks = Messages()
    run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24}, hooks=hooks)
    first = reference_lines(tmp_path)
    # The reference pass loads the weights; the policy's run then reuses that engine.
    assert sum("loading " in m for m in hooks.messages) == 1
    assert any("FullKV reference: loading" in m for m in hooks.messages)
    # A second policy reuses the entries; a FullKV run too (it finds them and adds none).
    hooks2 = Messages()
    snap = run(model_dir, tmp_path, policy="snapkv", policy_args={"budget": 48}, hooks=hooks2)
    full = run(model_dir, tmp_path, policy="full", hooks=hooks2)
    assert not any("FullKV reference" in m for m in hooks2.messages)
    assert reference_lines(tmp_path) == first
    passes = json.loads((snap.path / F.PASSES_FILE).read_text().splitlines()[-1])
    assert passes["reference_requests"] == 0 and passes["forced_requests"] == len(first)
    assert all(r["fid_agreement"] == 1.0 and r["fid_delta_nll"] == 0.0 for r in samples(full))


def test_reference_resumes_after_an_interruption(model_dir, tmp_path):
    """A FullKV run stopped after one request keeps that reference entry; the resumed run adds
    only the missing ones, and a policy run afterwards generates none."""

    class StopAfterOne(EvalHooks):
        def on_step(self, tokens, finished):
            if finished >= 1:
                raise KeyboardInterrupt

    # One request at a time, so the stop comes between requests.
    stopped = run(model_dir, tmp_path, policy="full", hooks=StopAfterOne(), max_num_seqs=1)
    assert stopped.interrupted
    kept = reference_lines(tmp_path)
    assert 1 <= len(kept) < 3
    run(model_dir, tmp_path, policy="full", max_num_seqs=1)
    after = reference_lines(tmp_path)
    assert after[:len(kept)] == kept and len(after) == 3
    hooks = Messages()
    run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24}, hooks=hooks)
    assert not any("FullKV reference" in m for m in hooks.messages)
    assert len(reference_lines(tmp_path)) == 3


def test_other_settings_get_their_own_reference(model_dir, tmp_path):
    run(model_dir, tmp_path)
    run(model_dir, tmp_path / "x", max_tokens=20)  # a separate tree keeps the result dirs apart
    run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24}, max_tokens=20)
    names = sorted(p.parent.name for p in tmp_path.glob(f"*/gsm8k/{F.REFERENCE_DIR}/*/{F.REFERENCE_FILE}"))
    assert len(names) == 2 and names[0].startswith("mt20-") and names[1].startswith("mt40-")


def test_sampled_decoding_uses_fullkv_sample_with_the_same_seed(model_dir, tmp_path):
    kw = dict(temperature=0.9, samples=2, seed=7)
    run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24}, **kw)
    refs = {(e["uid"], e["sample"]): e for e in reference_lines(tmp_path)}
    assert {e["seed"] for e in refs.values()} == {7, 8}  # sample j: seed + j
    # The FullKV run (same seeds) reproduces the reference samples: agreement 1 on every one,
    # while two samples of a problem differ (so the seeds matter).
    full = run(model_dir, tmp_path, policy="full", **kw)
    rows = samples(full)
    assert all(r["fid_agreement"] == 1.0 for r in rows)
    assert any(refs[(u, 0)]["tokens"] != refs[(u, 1)]["tokens"] for u in {k[0] for k in refs})
    # The budget above every sequence reproduces them too.
    snap = samples(run(model_dir, tmp_path, policy="snapkv", policy_args={"budget": 1024}, **kw))
    assert all(r["fid_agreement"] == 1.0 and abs(r["fid_delta_nll"]) < 1e-5 for r in snap)


def test_no_fidelity_leaves_the_fields_empty(model_dir, tmp_path):
    rows = samples(run(model_dir, tmp_path, policy="zipage", policy_args={"budget": 24}, fidelity=False))
    assert rows and all(r[k] is None for r in rows for k in F.FIELDS)
    assert not list(tmp_path.rglob(F.REFERENCE_FILE))


# ------------------------------------------------------------------------------ a shared reference

_SHARED = """
import json, os, sys, time, types
from pathlib import Path
import torch
torch.set_num_threads(1)
from engine.sampling import SamplingParams
from evals.run import fidelity as F
from evals.run.settings import EvalHooks

model, out, policy, meeting = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
config = {"model": "tiny", "model_spec": model, "task": "gsm8k", "task_options": {},
          "data_source": "fixture", "max_tokens": 8, "temperature": 0.0, "seed": 0, "thinking": None}
greedy = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
requests = [F.Request(f"q{i}", 0, 0, [10 + i, 20, 30, 40], greedy) for i in range(4)]
kwargs = {"policy": policy, "policy_args": {"budget": 48}, "block_size": 4, "kv_cache_tokens": 1024,
          "max_num_seqs": 4, "seed": 0}
real = F.Fidelity.ensure_reference

def meet(self, todo, *args):
    # Both invocations see every entry missing before either starts generating.
    (meeting / str(os.getpid())).write_text(str(len(self.missing(todo))))
    deadline = time.monotonic() + 120
    while len(list(meeting.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return real(self, todo, *args)

F.Fidelity.ensure_reference = meet
said = []
class Hooks(EvalHooks):
    def on_message(self, text):
        said.append(text)
settings = types.SimpleNamespace(out=out, policy=policy, model=model)
fid = F.start(settings, config, requests, kwargs, Hooks())
print(json.dumps({"generated": fid.timing["reference_requests"], "said": said}))
"""


def test_two_invocations_at_once_generate_the_shared_reference_once(model_dir, tmp_path):
    """Two policies evaluated at once on one --out: the second waits for the first's reference
    pass and reuses its entries, so the reference holds one entry per sample."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _SHARED, str(model_dir), str(tmp_path / "out"), policy,
                               str(meeting)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for policy in ("snapkv", "streamingllm")]
    got = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        got.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [m.read_text() for m in meeting.iterdir()] == ["4", "4"]  # both found all 4 missing
    assert sorted(g["generated"] for g in got) == [0, 4]
    lines = reference_lines(tmp_path / "out")
    assert sorted(e["uid"] for e in lines) == ["q0", "q1", "q2", "q3"]
    waited = next(g for g in got if g["generated"] == 0)
    assert any("waiting for another kvarena invocation" in m for m in waited["said"])


def test_reference_lines_are_written_once_whoever_adds_them(tmp_path):
    from types import SimpleNamespace

    config = {"model": "m", "model_spec": "m", "task": "gsm8k", "task_options": {}, "data_source": "d",
              "max_tokens": 4, "temperature": 0.0, "seed": 0, "thinking": None}
    first, second = F.Reference.open(tmp_path, config), F.Reference.open(tmp_path, config)
    out = SimpleNamespace(token_ids=[1, 2], token_logprobs=[-0.5, -1.0], finish_reason="length")
    other = SimpleNamespace(token_ids=[3], token_logprobs=[-2.0], finish_reason="stop")
    kept = first.add("u", 0, "sha", 0, out)
    assert second.add("u", 0, "sha", 0, other) == kept  # the line already there wins
    with open(first.path / F.REFERENCE_FILE, "a") as f:
        f.write('{"uid": "cut')  # a crash mid-line
    second.add("v", 0, "sha", 0, other)
    lines = (first.path / F.REFERENCE_FILE).read_text().splitlines()
    assert json.loads(lines[0])["uid"] == "u" and lines[1] == '{"uid": "cut'
    assert json.loads(lines[2])["uid"] == "v" and len(lines) == 3  # the cut line stays its own
    assert set(F.Reference.open(tmp_path, config).entries) == {("u", 0, "sha"), ("v", 0, "sha")}


def test_a_dead_holder_of_the_reference_lock_blocks_nothing(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import threading

    config = {"model": "m", "model_spec": "m", "task": "gsm8k", "task_options": {}, "data_source": "d",
              "max_tokens": 4, "temperature": 0.0, "seed": 0, "thinking": None}
    ref = F.Reference.open(tmp_path, config)
    root = Path(__file__).resolve().parents[1]
    holder = ("import sys, time\nfrom evals.run import fidelity as F\n"
              f"ref = F.Reference.open({str(tmp_path)!r}, {config!r})\n"
              "with ref.generating(print):\n    print('held', flush=True)\n    time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout.readline().strip() == "held"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (ref.path / R.LOCK_FILE).read_text()  # its holder line stays behind
    said, done = [], threading.Event()

    def take():
        with ref.generating(said.append):
            done.set()

    threading.Thread(target=take, daemon=True).start()
    assert done.wait(30) and not said
