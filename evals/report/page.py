"""The report page: one self-contained HTML file (CSS and JS inline, the data as embedded JSON), no
server and no network; it opens from disk.

The data (evals.report.data) goes into ``<script type="application/json" id="report-data">`` with
every ``<`` and ``/`` escaped (``\\u003c``, ``\\/``), so no text inside it (a model's output, a path)
can close the script element or read as an address. ``assets/report.js`` renders it. A small first
script collects uncaught errors and ``console.error`` calls into ``#report-errors`` (visible on the
page, and to a headless browser's ``--dump-dom``); the renderer sets ``data-rendered="yes"`` on
``<body>`` when it has drawn every section.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from evals.jsonio import set_mode
from evals.report.data import Cleaned, clean, clean_text

ASSETS = Path(__file__).parent / "assets"
SECTIONS = ("leaderboard", "figures", "samples", "niah", "capacity", "provenance")  # section ids: sec-<name>

_ERRORS_JS = """(function () {
  var box = null, pending = [];
  function show(text) {
    box = box || document.getElementById("report-errors");
    if (!box) { pending.push(text); return; }
    box.className = "shown";
    box.textContent += text + "\\n";
  }
  window.addEventListener("error", function (e) {
    show("error: " + e.message + " (line " + e.lineno + ")");
  });
  window.addEventListener("unhandledrejection", function (e) { show("unhandled rejection: " + e.reason); });
  var original = console.error;
  console.error = function () {
    show("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
  document.addEventListener("DOMContentLoaded", function () { pending.splice(0).forEach(show); });
})();"""

_BODY = """<header>
  <h1>{title}</h1>
  <div class="sub" id="generated"></div>
  <div class="notes" id="notes"></div>
</header>
<nav>
  <a href="#sec-leaderboard">Leaderboard</a><a href="#sec-figures">Figures</a>
  <a href="#sec-samples">Per sample</a>
  <a href="#sec-niah">NIAH</a><a href="#sec-capacity">Capacity</a>
  <a href="#sec-provenance">Config &amp; provenance</a>
</nav>
<pre id="report-errors"></pre>
<main>
<section id="sec-leaderboard">
  <h2>Leaderboard</h2>
  <p class="help">One row per run (model &times; task &times; method). Each figure is the mean with
  &plusmn; half the width of its 95% bootstrap interval (over problems, samples nested; hover for
  the interval). Fidelity columns compare with FullKV on the same prompts: delta-NLL is the
  policy's extra negative log-likelihood of FullKV's continuation (nats/token, 0 = FullKV), token
  agreement the share of FullKV's tokens the policy's free generation reproduces. TPS is
  run-level, timed alone at whatever load the machine had. A flagged row (&#9888;) does not
  compare with its task's FullKV run (other generation settings, unfinished, no FullKV run) and
  says why. prov: the code and machine a run came from (letters explained at the bottom);
  &ne; marks a run whose code or machine differs from its FullKV run's or mixes several (hover for
  which): its settings compare, but a difference is not the policy's alone. Click a header to
  sort.</p>
  <div class="controls" id="board-controls"></div>
  <div class="small" id="board-count"></div>
  <div id="board"></div>
</section>
<section id="sec-figures">
  <h2>Drift from FullKV by position; quality and drift against the KV kept</h2>
  <p class="help">As in the leaderboard's files: delta-NLL by position in the document
  (long-document runs: every token of real text forced under the policy; one line per run, its
  95% interval over documents); delta-NLL against the KV slots that hold a kept token (one
  point per run, both intervals); and for each task with a budget sweep (a policy run at several
  budgets, <code>kvarena sweep</code>) pass@1, delta-NLL and token agreement against the KV kept,
  one line per policy and settings through its budgets, its 95% intervals as error bars and a
  band (a policy at one budget is one point).</p>
  <div id="figures"></div>
</section>
<section id="sec-samples">
  <h2>Per sample: where the policy departs from FullKV</h2>
  <p class="help">Pick a run, then a sample. Left: FullKV's continuation (the reference), each
  token shaded by how much less likely the policy found it in the teacher-forced pass (its
  delta-NLL). Right: the policy's own free generation. &#9654; marks the first token where they
  differ.</p>
  <div class="controls" id="samples-controls"></div>
  <div id="samples"></div>
</section>
<section id="sec-niah">
  <h2>Needle in a haystack</h2>
  <p class="help">Retrieval score (partial credit, not pass@1) per (context length, needle depth)
  cell for every policy: per sample 1 when the needle's key phrase is in the answer, else the share
  of it the answer recalls; the leaderboard's pass@1 counts only a found key phrase. Click a cell
  to see which prompt positions each layer and KV head kept after each compaction, with the
  needle's span marked (runs made with <code>--trace-kept</code>: their cells carry a blue
  bar).</p>
  <div id="niah"></div>
</section>
<section id="sec-capacity">
  <h2>Capacity against decode step</h2>
  <p class="help">Per request, the KV slots each policy held at every decode step, with its
  capacity decisions: GrowPage's Grow and Compress &amp; Hold, fallbacks (a grow the pool could not
  safely satisfy, answered by a compression), shrinks, prompt compression; periodic firings
  (Kara's windows) as ticks under the axis, on the same steps. Runs whose allocations are
  identical at every step share one line, drawn in turns (dashes of each run's colour), and a note
  under the chart names them.</p>
  <div class="controls" id="capacity-controls"></div>
  <div id="capacity"></div>
</section>
<section id="sec-provenance">
  <h2>Config and provenance</h2>
  <p class="help">What each provenance letter stands for (commit, uncommitted changes to the code,
  machine), and every run's full config.json: settings, policy arguments, engine, the command
  line.</p>
  <div id="provenance"></div>
</section>
</main>
<div class="tip" id="tip"></div>"""


def embed_json(data: Mapping[str, Any]) -> str:
    """``data`` as strict JSON (no NaN, valid UTF-8: evals.report.data.clean) that is safe inside
    a ``<script>`` element and holds no ``/`` at all."""
    text = json.dumps(clean(data, Cleaned()), ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace("/", "\\/")


def render(data: Mapping[str, Any]) -> str:
    """The whole page for ``data`` (evals.report.data.build_data)."""
    css = (ASSETS / "report.css").read_text(encoding="utf-8")
    js = (ASSETS / "report.js").read_text(encoding="utf-8")
    title = html.escape(clean_text(str(data.get("title", "kvarena report"))))
    body = _BODY.format(title=title)
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>",
        f"<script>{_ERRORS_JS}</script>",
        f"<style>\n{css}</style>",
        "</head><body>",
        body,
        f'<script type="application/json" id="report-data">{embed_json(data)}</script>',
        f"<script>\n{js}</script>",
        "</body></html>",
    ]) + "\n"


def write(data: Mapping[str, Any], out: str | Path) -> Path:
    """Render ``data`` into ``out`` (its folder is created); returns the path. The page is
    rendered whole, written to a temporary file beside ``out`` and renamed over it: a render
    error, a full disk or a kill leaves an existing page as it was, never a truncated one."""
    out = Path(out)
    page = render(data).encode("utf-8")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        try:
            set_mode(fd)
            with os.fdopen(fd, "wb") as f:
                f.write(page)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise OSError(f"cannot write the report to {out}: {e}") from e
    return out
