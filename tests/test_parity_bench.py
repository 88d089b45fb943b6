"""`kvarena bench parity` without kvpress: the comparison (kept sets -> agreement -> verdict) as pure
functions on crafted inputs, the kvpress driver's kept-position reading on crafted tensors, and
the subprocess protocol end to end with a stand-in peer (tests/fixtures/fake_kvpress_peer.py: the
real driver's loop and greedy decoding, StreamingLLM's kept sets for every press, one row changed
on request) whose answers the table must report, mismatch included."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from evals.benchmarks import parity, peer, peer_kvpress
from evals.benchmarks.parity import METHODS, KeptAgreement, compare_kept, verdict
from peer_venv import wrapper
from tiny_models import make_tiny_llama_dir

REPO = Path(__file__).resolve().parents[1]
FAKE_PEER = Path(__file__).parent / "fixtures" / "fake_kvpress_peer.py"


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An interpreter that passes the kvpress check: an empty `kvpress` package on its path (the
    stand-in peer never imports it)."""
    site = tmp_path / "site"
    (site / "kvpress").mkdir(parents=True)
    (site / "kvpress" / "__init__.py").write_text('"""Empty: found by the interpreter check."""\n')
    return wrapper(tmp_path, "fake-python", [site])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("parity"), name="tiny-parity"))


# ----------------------------------------------------------------------------------------------
# the comparison


def test_compare_kept_counts_equal_nested_and_overlapping_rows():
    ours = [[[0, 1, 2, 3], [0, 1, 2, 3]], [[0, 1, 5, 6], [0, 1, 2]]]
    theirs = [[[0, 1, 2, 3], [0, 1, 2, 4]], [[0, 1, 5, 7], [0, 1, 2, 3]]]
    kept = compare_kept(ours, theirs)
    assert (kept.rows, kept.equal, kept.nested) == (4, 1, 1)
    # Row Jaccards: 1, 3/5, 3/5, 3/4.
    assert kept.jaccard == pytest.approx((1 + 0.6 + 0.6 + 0.75) / 4)
    assert kept.jaccard_min == pytest.approx(0.6) and kept.worst == (0, 1, pytest.approx(0.6))
    assert kept.max_swaps == 1  # rows of equal counts swap one position each
    assert (kept.ours, kept.theirs) == (15, 16)
    assert kept.layer_counts == [(4, 4), (3.5, 4)] and not kept.same_counts
    merged = kept.merge(compare_kept(theirs, theirs)).merge(compare_kept(theirs, theirs))
    assert (merged.rows, merged.equal, merged.nested, merged.prompts) == (12, 9, 1, 3)
    assert merged.worst == kept.worst and merged.jaccard_min == kept.jaccard_min
    assert merged.layer_counts == [(4, 4), (pytest.approx(23 / 6), 4)]  # (3.5 + 4 + 4) / 3
    with pytest.raises(ValueError):
        kept.merge(compare_kept([[[0]]], [[[0]]]))  # another depth


def test_compare_kept_rejects_other_shapes_and_repeats():
    with pytest.raises(ValueError, match="different shapes"):
        compare_kept([[[0]], [[0]]], [[[0]]])
    with pytest.raises(ValueError, match="different shapes"):
        compare_kept([[[0], [1]]], [[[0]]])
    with pytest.raises(ValueError, match="layer 0, head 0: a kept set repeats"):
        compare_kept([[[0, 0]]], [[[0, 1]]])


def test_verdicts():
    snap, stream, pyramid, h2o = (METHODS[k] for k in ("snapkv", "streamingllm", "pyramidkv", "h2o"))
    same = compare_kept([[[0, 1, 2]]], [[[0, 1, 2]]])
    tokens_same = [([1, 2, 3], [1, 2, 3])]
    tokens_split = [([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 9, 3])]
    assert verdict(snap, same, tokens_same) == ("identical", "")
    assert verdict(METHODS["full"], None, tokens_same) == ("identical", "")
    name, why = verdict(snap, same, tokens_split)
    assert name == "same kept sets" and "1 of 2 continuations diverge (first at token 1)" in why
    # Nested rows only: the budgets differ, the selection does not.
    nested = compare_kept([[[0, 1, 2]], [[0, 1]]], [[[0, 1]], [[0, 1, 2]]])
    name, why = verdict(snap, nested, tokens_same)
    assert name == "budget differs" and "2 of 2 rows" in why and "By design" not in why
    assert "layer 0 / last: kvarena 3 / 2, kvpress 2 / 3" in why
    name, why = verdict(pyramid, nested, tokens_same)
    assert name == "budget differs" and why.endswith(pyramid.by_design)
    # One swapped position at the cut: close for a scored method, a discrepancy for StreamingLLM
    # (its positions follow from the lengths alone).
    swap = compare_kept([[[0, 1, 2], [0, 1, 2]]], [[[0, 1, 2], [0, 1, 3]]])
    name, why = verdict(snap, swap, tokens_same)
    assert name == "close" and "1 of 2 rows swap at most 1 position" in why
    name, why = verdict(stream, swap, tokens_same)
    assert name == "DIFFERENT" and "1 of 2 rows differ (lowest: layer 0, head 1, Jaccard 0.500)" in why
    assert verdict(h2o, swap, tokens_same) == ("different by design", h2o.by_design)
    # ChunkKV differs by design only on a prompt that ends in a partial chunk.
    chunk = METHODS["chunkkv"]
    assert verdict(chunk, swap, tokens_same, [256, 320])[0] == "close"
    name, why = verdict(chunk, swap, tokens_same, [256, 300, 310])
    assert name == "different by design" and why.startswith("a 300-token prompt ends in a partial")
    assert "a 310-token prompt" in why
    # Far apart with other counts: a discrepancy, counts named.
    far = compare_kept([[[0, 1, 2, 3]], [[0, 1]]], [[[4, 5, 6]], [[2, 3]]])
    name, why = verdict(snap, far, tokens_same)
    assert name == "DIFFERENT" and "2 of 2 rows differ" in why and "kvarena 4 / 2, kvpress 3 / 2" in why


def test_kept_agreement_of_nothing_is_nan():
    assert KeptAgreement().jaccard != KeptAgreement().jaccard


def test_budgets_and_settings():
    assert parity.floor_budget(256, 0.5) == 128 and parity.floor_budget(320, 0.3) == 224
    assert parity.floor_budget(3, 0.9) == 1
    assert parity.chunk_budget(256, 0.5) == 128 and parity.chunk_budget(320, 0.3) == 224
    assert parity.chunk_budget(300, 0.5) == 16 * 9  # ceil(300 / 16) = 19 chunks, 9 kept
    press = METHODS["adakv"].press(0.5)
    assert press.describe() == ("AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=64, "
                                "kernel_size=5), alpha_safeguard=0.0)")
    assert press.to_json()["inner"]["name"] == "SnapKVPress"
    assert METHODS["h2o"].press(0.25).describe().endswith("eager attention")
    assert METHODS["full"].press(0.5) is None
    assert METHODS["snapkv"].settings() == ("snapkv(window=64, pooling=avg, pooling_kernel=5), "
                                            "budget floor(T(1-c))")
    assert parity.layer_budgets([[[0, 1, 2], [0, 1, 3]], [[0], [1]]]) == ((3, 1), 2)
    with pytest.raises(parity.Unmatched, match="keep 3 positions in all, not a multiple of the 2"):
        parity.layer_budgets([[[0, 1], [2, 3]], [[0], [1]]])
    with pytest.raises(parity.Unmatched, match="layer 1 keeps \\[1, 2\\] positions"):
        parity.layer_budgets([[[0, 1], [2, 3]], [[0], [1, 2]]])
    for bad, message in [(dict(methods=("snapkv", "nope")), "--methods must name"),
                         (dict(lengths=(1,)), "--lengths"), (dict(ratio=1.0), "compression-ratio"),
                         (dict(tokens=0), "--tokens"), (dict(corpus="x"), "--corpus")]:
        with pytest.raises(ValueError, match=message):
            parity.ParitySettings("python", **bad)
    assert parity.ParitySettings("python", tokens=32).block_size == 32
    assert parity.ParitySettings("python", tokens=33).block_size == 64


def test_prompts_have_the_asked_lengths(tiny_model):
    from engine.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model)
    for corpus in parity.CORPORA:
        prompts = parity.build_prompts(tok, corpus, (40, 64, 700))
        assert [len(p) for p in prompts] == [40, 64, 700]
        assert prompts[0] != prompts[1][:40]  # each starts at its own paragraph
        assert prompts == parity.build_prompts(tok, corpus, (40, 64, 700))
    text = tok.decode(parity.build_prompts(tok, "gsm8k-mini", (40,))[0])
    assert text.startswith("Question: ")


# ----------------------------------------------------------------------------------------------
# the kvpress driver's pieces (torch only)


def test_kept_positions_read_the_compressed_keys():
    keys = torch.randn(1, 2, 10, 4)
    rows = [[7, 0, 3], [9, 2, 5]]
    kept_keys = torch.stack([keys[0, h, rows[h]] for h in range(2)])[None]
    assert peer_kvpress.kept_positions(keys, kept_keys) == [[0, 3, 7], [2, 5, 9]]
    masked = (torch.zeros(3, dtype=torch.long), torch.tensor([0, 0, 1]), torch.tensor([1, 4, 9]))
    assert peer_kvpress.kept_positions(keys, keys, masked) == [
        [0, 2, 3, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    twins = keys.clone()
    twins[0, 1, 6] = twins[0, 1, 2]
    with pytest.raises(ValueError, match="kept key 0 of head 1 matches 2 prefill positions"):
        peer_kvpress.kept_positions(twins, twins[:, :, [2, 3]])
    with pytest.raises(ValueError, match="matches 0"):
        peer_kvpress.kept_positions(keys, torch.zeros(1, 2, 1, 4))


def test_serve_answers_runs_and_reports_errors():
    class Stub:
        def info(self):
            return {"kvpress": "x"}

        def run(self, prompt, press, max_new_tokens):
            return {"kept": None, "tokens": list(prompt[:max_new_tokens]), "press": press}

    answers: list[dict] = []
    lines = ['{"op": "run", "prompt": [5, 6, 7], "max_new_tokens": 2}', "",
             '{"op": "nope"}', '{"op": "run", "prompt": [1], "max_new_tokens": 1}']
    assert peer_kvpress.serve(Stub, iter(lines), answers.append) == 1
    assert answers == [{"ready": True, "info": {"kvpress": "x"}},
                       {"kept": None, "tokens": [5, 6], "press": None},
                       {"error": "ValueError: unknown op 'nope'; valid: run, quit"}]
    answers.clear()
    assert peer_kvpress.serve(Stub, io.StringIO('{"op": "quit"}\n{"op": "nope"}\n'),
                              answers.append) == 0
    assert answers == [{"ready": True, "info": {"kvpress": "x"}}]


# ----------------------------------------------------------------------------------------------
# end to end through the subprocess


def test_a_python_without_kvpress_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    no_kvpress = wrapper(tmp_path, "plain-python", [REPO])
    for python, message in [(no_kvpress, "cannot import kvpress (install it: python3 -m venv"),
                            (str(tmp_path / "none" / "python"), "no such file (a venv with kvpress")]:
        out = CliRunner().invoke(app, ["bench", "parity", "--peer-python", python, "--threads", "1",
                                       "--out-dir", str(tmp_path)])
        assert out.exit_code == 2, out.output
        lines = out.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], out.output
    out = CliRunner().invoke(app, ["bench", "parity", "--peer-python", no_kvpress,
                                   "--methods", "snapkv,bogus"])
    assert out.exit_code == 2 and "--methods must name" in out.output
    assert not list(tmp_path.glob("parity*"))


def test_protocol_end_to_end_reports_the_mismatch(tiny_model, fake_python, monkeypatch):
    monkeypatch.setenv("FAKE_KVPRESS_MISMATCH", "1,0,48")
    settings = parity.ParitySettings(fake_python,
                                     methods=("full", "streamingllm", "pyramidkv-budgets"),
                                     lengths=(48, 64), ratio=0.5, tokens=4)
    lines: list[str] = []
    result = parity.run_parity(tiny_model, settings=settings, driver=FAKE_PEER, log=lines.append)
    full, stream, pyramid = result.table("summary").rows
    # No press: the real driver's greedy transformers against kvarena on the same weights.
    assert full["verdict"] == "identical" and full["continuation"] == "1.000 (2/2 identical)"
    # 2 layers x 2 KV heads x 2 prompts; the fake moved one position of layer 1, head 0 in the
    # 48-token prompt. Every other row agrees: kvarena's StreamingLLM keeps exactly the sinks and
    # the most recent tokens the fake worked out.
    assert stream["rows_equal"] == "7/8" and stream["rows_nested"] == 0
    assert stream["kept"] == "28.0 / 28.0"  # floor(48 / 2) and floor(64 / 2), on average
    assert stream["verdict"] == "DIFFERENT"
    assert "1 of 8 rows differ (lowest: layer 1, head 0, Jaccard 0.920)" in stream["why"]
    per_prompt = result.table("prompts").rows
    assert [(r["method"], r["prompt_tokens"], r["budget"], r["rows_equal"])
            for r in per_prompt[:4]] == [
        ("FullKV", 48, None, None), ("FullKV", 64, None, None),
        ("StreamingLLM", 48, 24, "3/4"), ("StreamingLLM", 64, 32, "4/4")]
    # PyramidKV took each layer's count from the peer's answer (the fake's 24 and 32 per head).
    assert [(r["budget"], r["kept_ours"], r["kept_theirs"]) for r in per_prompt[4:]] == [
        (24, 24, 24), (32, 32, 32)]
    assert pyramid["kept"] == "28.0 / 28.0"
    assert result.scale["kvpress"] == "0.0-fake" and "0.0-fake" in result.notes[0]
    assert any("StreamingLLM, prompt 1 (48 tokens): 3/4 rows equal" in line for line in lines)


def test_cli_writes_parity_markdown(tiny_model, fake_python, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli import app

    monkeypatch.setattr(parity, "DRIVER", FAKE_PEER)
    out = CliRunner().invoke(app, ["bench", "parity", "--peer-python", fake_python,
                                   "--model", tiny_model,
                                   "--threads", "1", "--methods", "tova", "--lengths", "48",
                                   "--tokens", "3", "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    payload = json.loads((tmp_path / "parity.json").read_text())
    assert payload["name"] == "parity" and payload["scale"]["methods"] == ["tova"]
    assert [t["name"] for t in payload["tables"]] == ["summary", "conventions", "prompts"]
    md = (tmp_path / "parity.md").read_text()
    assert "kvarena bench parity --peer-python" in md
    assert "| method | kvarena settings | kvpress arguments | kept rows equal |" in md
    assert "TOVAPress(compression_ratio=0.5)" in md


def test_driver_failure_reports_its_log(tiny_model, fake_python, tmp_path):
    """A peer that dies mid-run: one PeerError naming the kvpress driver and its kept log."""
    dying = tmp_path / "dying_peer.py"
    dying.write_text("import json, sys\nprint(json.dumps({'ready': True, 'info': {}}), flush=True)\n"
                     "sys.stdin.readline()\nprint('dying as asked', file=sys.stderr)\nsys.exit(3)\n")
    settings = parity.ParitySettings(fake_python, methods=("full",),
                                     lengths=(40,), tokens=2)
    with pytest.raises(peer.PeerError, match=r"the kvpress driver exited \(code 3\) during FullKV "
                                             r"on prompt 1") as err:
        parity.run_parity(tiny_model, settings=settings, driver=dying, log=lambda _: None)
    assert "dying as asked" in str(err.value)
    log = Path(str(err.value).split("its log ", 1)[1].split(":", 1)[0])
    assert log.is_file()
    log.unlink()
