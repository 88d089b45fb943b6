"""`kvarena report` (evals.report) on a results tree made here with a tiny random Llama: what the
runs record for it (traces.jsonl, forced log-probabilities), the page's data and structure (no
network reference, every section and table, the JS parses), and a headless-browser render
(Debian's chromium) with no console errors and a screenshot."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from evals import traces as T
from evals.report import Limits, build_data, build_report
from evals.report.page import SECTIONS, render
from evals.run import fidelity as F
from evals.run.runner import run_eval
from evals.run.settings import EvalSettings
from tiny_models import make_tiny_llama_dir

FIXTURES = Path(__file__).parent / "fixtures" / "data"
CHROMIUM = "/usr/bin/chromium"
# block 4: a 48-token budget compresses NIAH prompts and GSM8K continuations.
ENGINE = dict(block_size=4, kv_cache_tokens=2048, temperature=0.0, trace_kept=True)
KARA = {"window_tokens": 16, "buffer_tokens": 4, "chunk_budget": 2, "max_chunk_gap": 2, "ratio": 0.4}
POLICIES = (("full", {}), ("snapkv", {"budget": 48, "window": 4}),
            ("growpage", {"initial_capacity": 16, "protected_recent": 2}), ("kara", KARA))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("report-llama"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def tree(tmp_path_factory, model):
    """Two NIAH cells and two GSM8K problems for FullKV, SnapKV, GrowPage and Kara."""
    out = tmp_path_factory.mktemp("results")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GSM8K fixture's malformed rows
        for policy, args in POLICIES:
            run_eval(EvalSettings(task="niah", policy=policy, policy_args=dict(args), model=str(model),
                                  data=str(FIXTURES / "niah"), out=str(out), max_tokens=6,
                                  task_options={"lengths": (320,), "depths": (25.0, 75.0)}, **ENGINE))
            run_eval(EvalSettings(task="gsm8k", policy=policy, policy_args=dict(args), model=str(model),
                                  data=str(FIXTURES / "gsm8k" / "test.jsonl"), out=str(out), limit=2,
                                  max_tokens=40, **ENGINE))
    return out


def _run(tree: Path, task: str, label: str) -> Path:
    (path,) = [p for p in tree.glob(f"*/{task}/*") if p.name.split("+")[0] == label]
    return path


def _samples(run: Path) -> dict:
    lines = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    return {(r["uid"], r["sample"]): r for r in lines}


# ------------------------------------------------------------------------------ what runs record


def test_encodings_round_trip():
    assert T.expand_runs(T.run_length([3, 3, 3, 5, 3])) == [3, 3, 3, 5, 3]
    pos = np.array([[[0, 2, 9]], [[1, 2, 3]]])
    mask = T.decode_kept(T.encode_kept(pos, 11))
    assert mask.shape == (2, 1, 11)
    assert [np.flatnonzero(m[0]).tolist() for m in mask] == [[0, 2, 9], [1, 2, 3]]
    lp = [-0.5, -1e-6, -12.25]
    assert F.decode_logprobs(F.encode_logprobs(lp)) == pytest.approx(lp, rel=1e-6)


def test_token_span_finds_the_text_it_was_asked_for(model):
    from engine.models.loader import load_tokenizer

    tok = load_tokenizer(model)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    start, end = T.token_span(tok.decode, ids, "brown fox")
    assert "brown fox" in tok.decode(ids[start:end])
    assert "brown fox" not in tok.decode(ids[start + 1:end])  # the smallest such span
    assert "brown fox" not in tok.decode(ids[start:end - 1])
    assert T.token_span(tok.decode, ids, "absent") is None


def test_pieces_rebuild_the_text_token_by_token(model):
    from engine.models.loader import load_tokenizer
    from evals.report.data import Pieces

    tok = load_tokenizer(model)
    text = "Grandma Rosa's café — 12 × 7 = 84 😀 lavender honey.\nThe answer is 84."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = Pieces(lambda spec: tok)("tiny", ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) == text
    assert Pieces(lambda spec: 1 / 0)("gone", [5, 7]) == ["⟨5⟩", "⟨7⟩"]  # no tokenizer: ids


def test_runs_record_traces_and_forced_logprobs(tree):
    for label in ("snapkv", "growpage", "kara"):
        run = _run(tree, "gsm8k", label)
        samples, traces = _samples(run), T.read_traces(run)
        forced = F.read_forced(run)
        assert set(traces) == set(samples) == set(forced)
        for key, rec in samples.items():
            t = traces[key]
            assert len(t["tokens"]) == rec["output_tokens"]
            assert sum(n for _, n in t["capacity"]) == rec["output_tokens"] - 1  # first token: prefill
            ref = F.reference_entries(run, json.loads((run / "config.json").read_text()))[key][-1]
            deltas = F.token_deltas(ref, forced[key]["logprobs"])
            assert np.mean(deltas) == pytest.approx(rec["fid_delta_nll"], abs=1e-5)
            assert sum(1 for e in t["events"] if e["action"] in ("grow", "compress", "shrink")) >= \
                sum(rec["decisions"].values())
    growpage = T.read_traces(_run(tree, "gsm8k", "growpage"))
    assert any(e["action"] == "grow" and e["trigger"] == "boundary" for t in growpage.values()
               for e in t["events"])


def test_kept_traces_are_positions_with_the_needle_span(tree):
    run = _run(tree, "niah", "snapkv")
    for t in T.read_traces(run).values():
        assert t["events"][t["kept"][0]["event"]]["trigger"] == "prefill"  # the prompt's first
        for kept in t["kept"]:
            event = t["events"][kept["event"]]
            mask = T.decode_kept(kept)
            assert mask.shape == (2, 2, t["prompt_tokens"] + event["step"])
            assert (mask.sum(-1) == event["physical"][1]).all()
            assert mask[..., -4:].all()  # SnapKV's observation window, in every head
            assert not (mask == mask[:1, :1]).all()  # heads keep different positions
        start, end = t["spans"]["needle"]
        assert 0 <= start < end <= t["prompt_tokens"]
    assert "kept" not in next(iter(T.read_traces(_run(tree, "niah", "full")).values()))


# ------------------------------------------------------------------------------ the page


def _data_of(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def _main_script(page: str) -> str:
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 2  # the error collector, the renderer
    return scripts[1]


def test_report_data(tree):
    data = build_data([tree])
    runs = {f"{r['task']}/{r['label']}": r for r in data["runs"]}
    assert len(runs) == 8 and all(r["comparable"] for r in runs.values())
    assert all(r["id"] == (tree / r["path"]).as_posix() and r["name"] == r["label"] for r in runs.values())
    snap = runs["niah/snapkv+budget=48+window=4+mt=6+bs=4"]  # the settings not the preset's
    assert snap["figures"]["pass@1"][1] is not None and snap["has_kept"] and snap["has_forced"]
    samples = data["samples"][snap["id"]]
    assert len(samples) == 2 and all(s["deltas"] is not None and s["pieces"] for s in samples)
    ref = data["references"][samples[0]["ref"]]
    assert len(ref["pieces"]) == len(samples[0]["deltas"])
    grid, = [g for g in data["niah"] if g["task"] == "niah"]
    assert grid["cells"] == [[320, 25.0], [320, 75.0]] and len(grid["rows"]) == 4
    assert grid["rows"][0]["label"].split("+")[0] == "full"  # FullKV's row first
    # Prompt compression: SnapKV and Kara (GrowPage grows through these short answers).
    assert {Path(k).name.split("+")[0] for k in data["kept"]} == {"snapkv", "kara"}
    assert all(Path(k).parent.name == "niah" for k in data["kept"])
    full = next(r for k, r in runs.items() if k.split("+")[0] == "gsm8k/full")
    gsm = data["capacity"][Path(full["id"]).parent.as_posix()]
    assert gsm["title"] == f"{snap['model']}/gsm8k"
    assert len(gsm["runs"]) == 4 and len(gsm["requests"]) == 2
    assert data["notes"] == []  # nothing sampled out at this size


def test_non_comparable_rows_are_flagged(tree, tmp_path):
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy)
    config_path = _run(copy, "gsm8k", "snapkv") / "config.json"
    config = json.loads(config_path.read_text())
    config["max_tokens"] = 99
    config_path.write_text(json.dumps(config))
    runs = {r["label"].split("+")[0] + "/" + r["task"]: r for r in build_data([copy])["runs"]}
    assert runs["snapkv/gsm8k"]["comparable"] is False
    assert runs["snapkv/gsm8k"]["reasons"] == ["max_tokens 99 vs FullKV's 40"]
    assert runs["snapkv/niah"]["comparable"] and runs["full/gsm8k"]["comparable"]


def test_each_run_compares_with_the_fullkv_run_of_its_settings():
    """Labels name settings that differ from the preset's, so one task may hold several FullKV
    runs: a run compares with the one of its own settings, else the plain ``full``."""
    from evals.report.data import COMPARED_SETTINGS, comparability, fullkv_run
    from evals.results.runs import RunResult

    def run(label, **config):
        base = {k: None for k in COMPARED_SETTINGS}
        return RunResult(Path(label), {**base, "label": label, "policy": label.split("+")[0],
                                       **config}, {"complete": True})

    full, long = run("full", max_tokens=64), run("full+mt=512+T=0", max_tokens=512, temperature=0.0)
    snap = run("snapkv+mt=512+T=0", max_tokens=512, temperature=0.0)
    other = run("snapkv+mt=99", max_tokens=99)
    assert fullkv_run(snap, [full, long]) is long and comparability(snap, long) == []
    assert fullkv_run(other, [full, long]) is full
    assert comparability(other, full) == ["max_tokens 99 vs FullKV's 64"]
    assert fullkv_run(long, [full, long]) is long and fullkv_run(snap, []) is None


def test_traces_are_sampled_and_the_page_says_so(tree):
    data = build_data([tree], Limits(samples_per_run=1, kept_per_sample=1, kept_bytes=10,
                                     events_per_request=1, capacity_requests=1))
    text = " ".join(data["notes"])
    for phrase in ("first 1 samples", "budget for them", "first 1 requests", "at most 1 events"):
        assert phrase in text
    assert all(len(v) <= 1 for v in data["samples"].values())


def test_page_is_self_contained_with_every_section(tree, tmp_path):
    path = build_report([tree], tmp_path / "r.html")
    page = path.read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?(?!#)[^"'\s>]*//""", page, re.I)
    # url(#id): an inline figure's reference to its own clip path, not to any resource
    assert not re.search(r"url\((?!#)|@import|<link|<img|<iframe|<script[^>]+src", page, re.I)
    for name in SECTIONS:
        assert f'id="sec-{name}"' in page
    for container in ("board", "samples", "niah", "capacity", "provenance", "report-errors"):
        assert f'id="{container}"' in page
    data = _data_of(page)
    assert data["runs"] and data["kept"] and data["capacity"]
    script = _main_script(page)
    # Every table the renderer builds (the NIAH grids are numbered per task).
    for table in ("leaderboard-table", "samples-table", "niah-grid-", "provenance-table"):
        assert table in script
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the script's syntax is not checked")
    js = tmp_path / "report.js"
    js.write_text(script, encoding="utf-8")
    subprocess.run(["node", "--check", str(js)], check=True, capture_output=True)


def test_the_page_shows_the_budget_sweep_figure_of_the_leaderboard(tmp_path):
    """Hand-written runs of a budget sweep (tests/result_trees.py): the page embeds the
    leaderboard's sweep figure as drawn (the same SVG), after the drift figures."""
    from evals.leaderboard import build_leaderboard
    from result_trees import write_sweep_tree

    root = write_sweep_tree(tmp_path / "results")
    board = build_leaderboard([root], tmp_path / "board")
    svg = board.files["sweep_gsm8k.png"].with_suffix(".svg").read_text(encoding="utf-8")
    data = build_data([root], pieces=lambda model, ids: [str(i) for i in ids])
    titles = [f["title"] for f in data["figures"]]
    assert titles == ["Drift from FullKV vs KV kept (95% intervals; 0 = FullKV)",
                      "GSM8K: quality and fidelity vs KV kept over budgets (policies run at "
                      "several budgets, and FullKV; 95% intervals)"]
    assert data["figures"][1]["svg"] == svg
    page = render(data)
    assert _data_of(page)["figures"][1]["svg"] == svg


def test_embedded_text_cannot_close_the_script_or_hold_an_address():
    page = render({"title": "t", "generated_utc": "", "roots": [], "columns": [], "runs": [],
                   "samples": {"x": [{"output": "</script><b>see https://example.org</b>"}]},
                   "references": {}, "niah": [], "kept": {}, "capacity": {}, "provenance": [],
                   "limits": {}, "notes": []})
    assert "https://" not in page and page.count("</script>") == 3
    assert _data_of(page)["samples"]["x"][0]["output"] == "</script><b>see https://example.org</b>"


def test_cli_report(tree, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["report", str(tree), "--out", str(tmp_path / "page.html")])
    assert result.exit_code == 0, result.output
    assert "page.html" in result.output and (tmp_path / "page.html").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(app, ["report", str(empty)])
    assert result.exit_code != 0 and "no result directories" in result.output
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["report", str(tree), "--out", str(blocker / "page.html")])
    assert result.exit_code != 0 and "cannot write the report" in result.output


# ------------------------------------------------------------------------------ headless browser


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--window-size=1400,2600", "--hide-scrollbars", "--virtual-time-budget=5000"]
    return subprocess.run([CHROMIUM, *flags, *extra, page.as_uri()], capture_output=True, text=True,
                          timeout=120)


def _rendered(dom: str) -> tuple[bool, str]:
    errors = re.search(r'<pre id="report-errors"[^>]*>(.*?)</pre>', dom, re.S)
    return 'data-rendered="yes"' in dom, errors.group(1).strip() if errors else "<no error box>"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed "
                    "(Debian: apt-get install chromium); the page's render is not checked")
def test_page_renders_in_headless_chromium_without_errors(tree, tmp_path):
    path = build_report([tree], tmp_path / "report.html")
    dom = _chromium(path, tmp_path / "profile-dom", "--dump-dom")
    ok, errors = _rendered(dom.stdout)
    assert ok and errors == "", (errors, dom.stderr[-2000:])
    assert "Uncaught" not in dom.stderr
    for marker in ('id="leaderboard-table"', 'id="samples-table"', 'id="niah-grid-0"',
                   'id="kept-canvas"', 'id="capacity-chart"', 'id="provenance-table"'):
        assert marker in dom.stdout
    shots = Path(os.environ.get("KVARENA_REPORT_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "report.png"
    _chromium(path, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
    # The check can fail: a page whose renderer throws is caught.
    broken = tmp_path / "broken.html"
    broken.write_text(path.read_text().replace('document.body.setAttribute("data-rendered", "yes");',
                                               'null.crash();'))
    ok, errors = _rendered(_chromium(broken, tmp_path / "profile-broken", "--dump-dom").stdout)
    assert not ok and "error" in errors


def _capacity_paths(dom: str) -> dict[str, dict[str, str]]:
    """{run id: the attributes of its capacity line} in the rendered capacity chart."""
    chart = re.search(r'<svg[^>]*id="capacity-chart".*?</svg>', dom, re.S).group(0)
    paths = {}
    for attrs in re.findall(r"<path ([^>]*)>", chart):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        if "data-run" in attrs:
            paths[html.unescape(attrs["data-run"])] = attrs
    return paths


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed "
                    "(Debian: apt-get install chromium); the page's render is not checked")
def test_identical_capacity_lines_are_drawn_in_turns_and_named(tree, tmp_path):
    """Runs whose capacity curves coincide at every step (GrowPage and Kara given FullKV's traces
    here) share one line: each draws dashes of its own colour in its own turn along the same path
    (no value moved), and a note under the chart names them; a line of its own stays solid."""
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy)
    full = _run(copy, "gsm8k", "full")
    for label in ("growpage", "kara"):
        shutil.copy(full / T.TRACES_FILE, _run(copy, "gsm8k", label) / T.TRACES_FILE)
    path = build_report([copy], tmp_path / "report.html")
    dom = _chromium(path, tmp_path / "profile", "--dump-dom").stdout
    ok, errors = _rendered(dom)
    assert ok and errors == "", errors
    group = _data_of(path.read_text())["capacity"][full.parent.as_posix()]
    first = group["requests"][0]  # the request shown first
    curves = {rid: json.dumps(series[first]["capacity"]) for rid, series in group["runs"].items()}
    paths = _capacity_paths(dom)
    assert set(paths) == set(curves) and len(curves) == 4
    shared = [rid for rid in curves if list(curves.values()).count(curves[rid]) > 1]
    assert {Path(rid).name.split("+")[0] for rid in shared} >= {"full", "growpage", "kara"}
    n = len(shared)
    for rid, attrs in paths.items():
        if rid in shared:  # one line, every run in its turn: dash 10, gap 10 x (n - 1)
            assert attrs["stroke-dasharray"] == f"10 {10 * (n - 1)}" and attrs["d"] == paths[shared[0]]["d"]
        else:
            assert "stroke-dasharray" not in attrs
    offsets = sorted(int(paths[rid]["stroke-dashoffset"]) for rid in shared)
    assert offsets == [10 * k for k in range(n)]  # each turn its own stretch of the line
    assert len({paths[rid]["stroke"] for rid in shared}) == n
    note = re.search(r'<div class="small shared-line">(.*?)</div>', dom, re.S).group(1)
    assert note.startswith(f"{n} runs share this line")
    assert all(html.unescape(note).count(f"{Path(rid).name}") for rid in shared)


# ------------------------------------------------------------------------------ hostile trees


def _rewrite_samples(run: Path, edit) -> None:
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    (run / "samples.jsonl").write_text("".join(json.dumps(edit(r)) + "\n" for r in rows))


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_runs_of_one_model_task_and_label_in_two_trees_stay_apart(tree, tmp_path):
    """Two trees under one root, or given as two roots: each run keeps its own samples and is
    compared with the FullKV run of its own directory."""
    root = tmp_path / "root"
    x, y = root / "x", root / "y"
    shutil.copytree(tree, x)
    shutil.copytree(tree, y)
    _rewrite_samples(_run(y, "gsm8k", "snapkv"), lambda r: {**r, "output": f"from y {r['uid']}"})
    _edit_json(_run(y, "gsm8k", "full") / "config.json", max_tokens=99)
    for dirs in ([root], [x, y]):
        data = build_data(dirs)
        runs = {r["id"]: r for r in data["runs"]}
        assert len(runs) == 16
        snap_x, snap_y = (runs[_run(t, "gsm8k", "snapkv").as_posix()] for t in (x, y))
        assert snap_x["comparable"], snap_x["reasons"]
        assert snap_y["reasons"] == ["max_tokens 40 vs FullKV's 99"]
        assert all(s["output"].startswith("from y") for s in data["samples"][snap_y["id"]])
        assert not any(s["output"].startswith("from y") for s in data["samples"][snap_x["id"]])
        for run in (snap_x, snap_y):  # each sample's reference is its own tree's
            assert all(s["ref"].startswith(run["group"] + "/") for s in data["samples"][run["id"]])
        names = [r["name"] for r in data["runs"]]
        assert len(set(names)) == 16 and snap_x["name"].startswith(snap_x["label"] + " (")
        assert len(data["niah"]) == 2 and len({g["title"] for g in data["niah"]}) == 2
        assert len(data["capacity"]) == 4 and len({g["title"] for g in data["capacity"].values()}) == 4


def _hostile(tree: Path, root: Path) -> dict[str, Path]:
    """A copy of ``tree`` with one hostile edit per run it names."""
    shutil.copytree(tree, root)
    runs = {"metrics": _run(root, "gsm8k", "snapkv"), "samples": _run(root, "gsm8k", "kara"),
            "config": _run(root, "gsm8k", "full"), "niah": _run(root, "niah", "full"),
            "traces": _run(root, "niah", "snapkv"), "typed": _run(root, "gsm8k", "growpage")}
    metrics = json.loads((runs["metrics"] / "metrics.json").read_text())
    (runs["metrics"] / "metrics.json").write_text(json.dumps({**metrics, "fid_delta_nll": float("nan"),
                                                              "tps": float("inf")}))
    _rewrite_samples(runs["samples"], lambda r: {**r, "fid_delta_nll": float("-inf")})
    _edit_json(runs["config"] / "config.json", data_source="\udcff data")  # a lone surrogate
    _rewrite_samples(runs["niah"], lambda r: {**r, "meta": {**r["meta"], "context_length": 320.5}})
    traces = runs["traces"] / "traces.jsonl"
    lines = traces.read_bytes().splitlines(keepends=True)
    cut = '{"uid": "niah/cut", "sample": 0, "spans": {"needle": "café"}}\n'.encode()
    traces.write_bytes(lines[0] + cut[:cut.index("é".encode()) + 1] + b"\n" + b"".join(lines[1:])
                       + cut[:cut.index("é".encode()) + 1])  # a middle line and the last cut inside é
    _rewrite_samples(runs["typed"], lambda r: {**r, "score": "high"})
    grow = _run(root, "niah", "growpage")
    runs["name"] = Path(os.fsdecode(os.fsencode(grow) + b"-\xff"))
    os.rename(grow, runs["name"])
    runs["list"] = root / "m" / "gsm8k" / "listed"
    runs["list"].mkdir(parents=True)
    (runs["list"] / "config.json").write_text("[]")
    (runs["list"] / "metrics.json").write_text("{}")
    return runs


def test_a_hostile_tree_renders_what_it_can_and_lists_what_it_cannot(tree, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    runs = _hostile(tree, tmp_path / "hostile")
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(tmp_path / "hostile"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_bytes().decode("utf-8")  # strict UTF-8 throughout
    data = _data_of(page)
    notes = data["notes"]
    by_path = {r["path"].split("/", 1)[1]: r for r in data["runs"]}
    assert len(by_path) == 8  # the one whose config.json is a list is the only run left out
    assert any("listed: config.json holds a JSON list" in n for n in notes)

    def note(run: Path, *words: str) -> str:
        (line,) = [n for n in notes if run.as_posix() in n and all(w in n for w in words)]
        return line

    note(runs["metrics"], "2 NaN or infinite value(s) in metrics.json")
    snap = by_path["gsm8k/" + runs["metrics"].name]
    assert snap["figures"]["fid_delta_nll"][0] is None and snap["figures"]["tps"][0] is None
    note(runs["samples"], "2 NaN or infinite value(s) in its samples")
    kara = data["samples"][by_path["gsm8k/" + runs["samples"].name]["id"]]
    assert all(s["fid"]["fid_delta_nll"] is None for s in kara)
    note(runs["config"], "not valid UTF-8")
    assert by_path["gsm8k/" + runs["config"].name]["config"]["data_source"] == "\ufffd data"
    note(runs["niah"], "2 sample(s) in the NIAH grid", "context_length 320.5 is not a whole number")
    note(runs["traces"], "2 line(s) of traces.jsonl")
    note(runs["typed"], "the samples", "'score' must be a number in [0, 1]")
    assert data["samples"][by_path["gsm8k/" + runs["typed"].name]["id"]] == []
    shown = [r for r in data["runs"] if "\ufffd" in r["id"]]
    assert len(shown) == 1 and shown[0]["id"] == runs["name"].as_posix().encode(
        "utf-8", "surrogateescape").decode("utf-8", "replace")
    assert data["samples"][shown[0]["id"]]  # its samples and traces are read under that name
    assert any(shown[0]["id"] in n and "path is not valid UTF-8" in n for n in notes)
    assert all(len(n.splitlines()) == 1 for n in notes)
    if os.path.exists(CHROMIUM):
        dom = _chromium(out, tmp_path / "profile", "--dump-dom")
        ok, errors = _rendered(dom.stdout)
        assert ok and errors == "", (errors, dom.stderr[-2000:])


def test_a_page_is_written_whole_or_not_at_all(tree, tmp_path, monkeypatch):
    from evals.report import page as P

    out = tmp_path / "report.html"
    out.write_text("the earlier report")
    data = build_data([tree])
    for where, error in ((P, "render"), (os, "fsync")):
        def fail(*a, **k):
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(where, error, fail)
            with pytest.raises(OSError):
                P.write(data, out)
        assert out.read_text() == "the earlier report"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary file
    P.write({**data, "title": "\udcff"}, out)  # text that cannot be UTF-8 is replaced, not fatal
    assert _data_of(out.read_bytes().decode("utf-8"))["runs"] and oct(out.stat().st_mode & 0o777) == "0o644"


def test_outputs_are_cut_and_traces_read_line_by_line(tree, tmp_path):
    import tracemalloc

    from evals.report.data import Pieces

    root = tmp_path / "big"
    shutil.copytree(tree, root)
    ids = Pieces(lambda spec: None)  # token ids instead of text: no tokenizer in the measurement
    tracemalloc.start()
    try:
        build_data([root], pieces=ids)
        baseline = tracemalloc.get_traced_memory()[1]
        snap = _run(root, "gsm8k", "snapkv")
        _rewrite_samples(snap, lambda r: {**r, "output": "y" * 2_000_000})
        pad = "z" * 20_000  # 1,500 requests of 20 kB: a 30 MB traces.jsonl
        with open(_run(root, "gsm8k", "growpage") / "traces.jsonl", "a") as f:
            for i in range(1500):
                f.write(json.dumps({"uid": f"gsm8k/extra{i}", "sample": 0, "tokens": [1, 2],
                                    "capacity": [[8, 1]], "events": [], "pad": pad}) + "\n")
        tracemalloc.reset_peak()
        data = build_data([root], pieces=ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    shown = data["samples"][snap.as_posix()]
    assert all(len(s["output"]) == 4000 and s["output_cut"] == 2_000_000 - 4000 for s in shown)
    assert any("first 4000 characters" in n for n in data["notes"])
    # The 4 MB of outputs are read with their samples; the 30 MB of traces never are whole.
    assert peak - baseline < 4 * 2_000_000 + 8_000_000, (peak, baseline)
    assert len(render(data)) < 2_000_000


def test_the_page_says_at_its_top_when_its_runs_mix_code_versions(tmp_path):
    """Runs from two commits: the header's notes count the versions and the runs whose code
    differs from their FullKV run's; one version: no such note."""
    from result_trees import PROV_A, PROV_B, write_run

    write_run(tmp_path / "one", "gsm8k", "full", {}, 10, 100.0, PROV_A)
    write_run(tmp_path / "one", "gsm8k", "snapkv", {"budget": 64}, 8, 64.0, PROV_A)
    assert not any("code versions" in n for n in build_data([tmp_path / "one"])["notes"])
    write_run(tmp_path / "two", "gsm8k", "full", {}, 10, 100.0, PROV_A)
    write_run(tmp_path / "two", "gsm8k", "snapkv", {"budget": 64}, 8, 64.0, PROV_B)
    write_run(tmp_path / "two", "gsm8k", "h2o", {"budget": 64}, 8, 64.0, PROV_A)
    (note,) = [n for n in build_data([tmp_path / "two"])["notes"] if "code versions" in n]
    assert note.startswith("These 3 runs come from 2 code versions or machines (letters A, B")
    assert "1 of them differ from their FullKV run's" in note
