/* kvarena report: renders the embedded data (script#report-data) into the page's sections.
   No libraries, no network: everything is drawn with DOM tables, SVG and canvas. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("report-data").textContent);
  /* The SVG namespace is a name, not an address: spelled in pieces so the page holds no URL. */
  var SVGNS = "http:" + "\u002f\u002f" + "www.w3.org\u002f2000\u002fsvg";
  var PALETTE = ["#2f5fb3", "#d1495b", "#2a9d8f", "#e09f3e", "#6a4c93", "#3d405b", "#8ab17d",
                 "#b56576", "#00798c", "#edae49", "#9c6644", "#577590"];
  var RUNS = {};
  DATA.runs.forEach(function (r) { RUNS[r.id] = r; });

  /* ---------------------------------------------------------------- helpers */
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        if (k === "text") { e.textContent = attrs[k]; }
        else if (k === "cls") { e.className = attrs[k]; }
        else if (k.slice(0, 2) === "on") { e.addEventListener(k.slice(2), attrs[k]); }
        else { e.setAttribute(k, attrs[k]); }
      });
    }
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) { return; }
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }
  function svg(tag, attrs, children) {
    var e = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) { if (c) { e.appendChild(c); } });
    return e;
  }
  function svgTitle(text) { var t = svg("title"); t.textContent = text; return t; }
  function clear(node) { while (node.firstChild) { node.removeChild(node.firstChild); } return node; }
  function fmt(v, d) {
    if (v === null || v === undefined || isNaN(v)) { return "-"; }
    var text = Number(v).toFixed(d);
    return /^-[0.]+$/.test(text) ? text.slice(1) : text;  /* no "-0.000" */
  }
  function uniq(xs) { return xs.filter(function (x, i) { return xs.indexOf(x) === i; }); }
  function option(value, text, selected) {
    var o = el("option", {value: value, text: text});
    if (selected) { o.selected = true; }
    return o;
  }
  function niceStep(max) {
    var raw = Math.max(1, max) / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var f = raw / mag;
    return Math.max(1, (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag);
  }
  function expandRuns(runs) {
    var out = [];
    runs.forEach(function (r) { for (var i = 0; i < r[1]; i++) { out.push(r[0]); } });
    return out;
  }
  function bitsOf(entry) {
    var raw = atob(entry.bits), bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) { bytes[i] = raw.charCodeAt(i); }
    var per = Math.ceil(entry.n / 8);
    return function (row, p) { return (bytes[row * per + (p >> 3)] >> (7 - (p & 7))) & 1; };
  }
  function scoreColor(s) {
    var h = Math.round(120 * Math.max(0, Math.min(1, s)));
    return "hsl(" + h + ", 65%, 72%)";
  }
  function runColor(id) {
    var i = DATA.runs.map(function (r) { return r.id; }).indexOf(id);
    return PALETTE[i % PALETTE.length];
  }

  /* ---------------------------------------------------------------- header */
  function renderHeader() {
    document.getElementById("generated").textContent =
      DATA.runs.length + " runs from " + DATA.roots.join(", ") + "; generated " + DATA.generated_utc + " UTC";
    var box = document.getElementById("notes");
    if (!DATA.notes.length) { box.style.display = "none"; return; }
    box.appendChild(el("strong", {text: "What this page leaves out or could not show"}));
    box.appendChild(el("ul", null, DATA.notes.map(function (n) { return el("li", {text: n}); })));
  }

  /* ---------------------------------------------------------------- leaderboard */
  var board = {task: "", model: "", policy: "", comparable: false, sort: null, dir: 1, more: false};
  /* Shown by default; the others behind "more columns". */
  var MAIN_COLUMNS = ["pass@1", "mean_score", "fid_delta_nll", "fid_agreement", "avg_kv_budget", "tps"];

  function figureCell(fig, d, pct) {
    if (!fig || fig[0] === null) { return el("td", {text: "-"}); }
    var v = fig[0], lo = fig[1], hi = fig[2];
    var kids = [fmt(v, d)];
    if (lo !== null && hi !== null) {
      kids.push(el("span", {cls: "ci", text: " \u00b1 " + fmt((hi - lo) / 2, d)}));
    }
    var td = el("td", null, kids);
    if (lo !== null && hi !== null) { td.title = "95% interval [" + fmt(lo, d) + ", " + fmt(hi, d) + "]"; }
    return td;
  }

  function renderBoardControls() {
    var c = document.getElementById("board-controls");
    var tasks = uniq(DATA.runs.map(function (r) { return r.task; }));
    var models = uniq(DATA.runs.map(function (r) { return r.model; }));
    var tsel = el("select", {id: "f-task", onchange: function () { board.task = this.value; renderBoard(); }},
      [option("", "all tasks")].concat(tasks.map(function (t) { return option(t, t); })));
    var msel = el("select", {id: "f-model", onchange: function () { board.model = this.value; renderBoard(); }},
      [option("", "all models")].concat(models.map(function (m) { return option(m, m); })));
    var ptext = el("input", {type: "text", id: "f-policy", placeholder: "policy contains\u2026",
      oninput: function () { board.policy = this.value.toLowerCase(); renderBoard(); }});
    var cb = el("input", {type: "checkbox", id: "f-comparable",
      onchange: function () { board.comparable = this.checked; renderBoard(); }});
    c.appendChild(el("label", null, ["task ", tsel]));
    c.appendChild(el("label", null, ["model ", msel]));
    c.appendChild(el("label", null, ["policy ", ptext]));
    c.appendChild(el("label", null, [cb, " comparable rows only"]));
    var more = el("input", {type: "checkbox", id: "f-more",
      onchange: function () { board.more = this.checked; renderBoard(); }});
    c.appendChild(el("label", null, [more, " more columns (worst window, first divergence, KV allocated, grow ratio)"]));
  }

  function sortValue(r, key) {
    if (key === "model" || key === "task" || key === "label" || key === "prov") { return r[key]; }
    if (key === "samples") { return r.samples_done; }
    var f = r.figures[key];
    return f ? f[0] : null;
  }

  function renderBoard() {
    var rows = DATA.runs.filter(function (r) {
      return (!board.task || r.task === board.task) && (!board.model || r.model === board.model) &&
        (!board.policy || r.label.toLowerCase().indexOf(board.policy) >= 0) &&
        (!board.comparable || r.comparable);
    });
    var cols = DATA.columns.filter(function (c) {
      return (board.more || MAIN_COLUMNS.indexOf(c.key) >= 0) && DATA.runs.some(function (r) { return r.figures[c.key]; });
    });
    var oneModel = uniq(DATA.runs.map(function (r) { return r.model; })).length === 1;
    if (board.sort) {
      rows = rows.slice().sort(function (a, b) {
        var x = sortValue(a, board.sort), y = sortValue(b, board.sort);
        if (x === null || x === undefined) { return 1; }
        if (y === null || y === undefined) { return -1; }
        return (x < y ? -1 : x > y ? 1 : 0) * board.dir;
      });
    }
    function head(key, title, cls, help) {
      var arrow = board.sort === key ? (board.dir > 0 ? " \u25b2" : " \u25bc") : "";
      return el("th", {cls: "sortable " + (cls || ""), title: (help ? help + "; " : "") + "click to sort", onclick: function () {
        board.dir = board.sort === key ? -board.dir : 1; board.sort = key; renderBoard();
      }}, [title, el("span", {cls: "arrow", text: arrow})]);
    }
    var thead = el("tr", null, (oneModel ? [] : [head("model", "model", "text")]).concat([head("task", "task", "text"),
      head("label", "method", "text"), head("prov", "prov", "text")]).concat(cols.map(function (c) { return head(c.key, c.title, "", c.help); }))
      .concat([head("samples", "samples")]));
    var body = rows.map(function (r) {
      var pct = function (c) { return c.key === "pass@1" || c.key === "fid_agreement"; };
      var method = el("td", {cls: "text method", title: r.path}, [r.name]);
      if (!r.comparable) {
        method.appendChild(el("div", {cls: "reasons", text: "\u26a0 not comparable: " + r.reasons.join("; ")}));
      }
      var cells = (oneModel ? [] : [el("td", {cls: "text", text: r.model})]).concat(
        [el("td", {cls: "text", text: r.task_title}), method]);
      var prov = el("td", {cls: "text", text: r.prov + (r.cautions.length ? " \u2260" : "")});
      if (r.cautions.length) { prov.title = r.cautions.join("; "); prov.className = "text caution"; }
      cells.push(prov);
      cols.forEach(function (c) { cells.push(figureCell(r.figures[c.key], c.decimals, pct(c))); });
      cells.push(el("td", {text: r.samples_done + " / " + r.samples_planned + (r.failed ? " (" + r.failed + " failed)" : "") +
        (r.ungraded ? " (" + r.ungraded + " ungraded)" : "")}));
      return el("tr", {cls: r.comparable ? "" : "flagged"}, cells);
    });
    var table = el("table", {id: "leaderboard-table"}, [el("thead", null, [thead]), el("tbody", null, body)]);
    clear(document.getElementById("board")).appendChild(el("div", {cls: "scroll"}, [table]));
    document.getElementById("board-count").textContent = rows.length + " of " + DATA.runs.length + " runs shown" +
      (oneModel ? " (model: " + DATA.runs[0].model + ")" : "");
  }

  /* ---------------------------------------------------------------- per-sample view */
  var sampleState = {run: null, index: 0};

  function runOptions(filter, selected) {
    var groups = {};
    DATA.runs.filter(filter).forEach(function (r) {
      var g = r.model + " / " + r.task_title;
      (groups[g] = groups[g] || []).push(r);
    });
    return Object.keys(groups).map(function (g) {
      return el("optgroup", {label: g}, groups[g].map(function (r) {
        return option(r.id, r.name + (r.comparable ? "" : "  \u26a0"), r.id === selected);
      }));
    });
  }

  function renderSamplesControls() {
    var withSamples = function (r) { return (DATA.samples[r.id] || []).length > 0; };
    var first = DATA.runs.filter(function (r) { return withSamples(r) && r.policy !== "full"; })[0] ||
      DATA.runs.filter(withSamples)[0];
    if (!first) {
      document.getElementById("samples").appendChild(el("p", {cls: "empty", text: "No samples recorded."}));
      return;
    }
    sampleState.run = first.id;
    var sel = el("select", {id: "sample-run", onchange: function () {
      sampleState.run = this.value; sampleState.index = 0; renderSamples();
    }}, runOptions(withSamples, first.id));
    document.getElementById("samples-controls").appendChild(el("label", null, ["run ", sel]));
    renderSamples();
  }

  function renderSamples() {
    var list = DATA.samples[sampleState.run] || [];
    var rows = list.map(function (s, i) {
      var f = s.fid || {};
      var tr = el("tr", {cls: "clickable" + (i === sampleState.index ? " selected" : ""), onclick: function () {
        sampleState.index = i; renderSamples();
      }}, [el("td", {cls: "text", text: s.uid}), el("td", {text: String(s.sample)}),
        el("td", {text: s.status !== "ok" ? s.status : (s.ungraded ? "ungraded" : (s.correct ? "\u2713" : "\u2717"))}),
        el("td", {text: fmt(s.score, 2)}), el("td", {text: fmt(f.fid_delta_nll, 4)}),
        el("td", {text: fmt(f.fid_worst_window, 3)}),
        el("td", {text: f.fid_agreement === null || f.fid_agreement === undefined ? "-" : fmt(100 * f.fid_agreement, 1)}),
        el("td", {text: s.div === null || s.div === undefined ? "none" : String(s.div)})]);
      return tr;
    });
    var head = el("tr", null, ["problem", "sample", "correct", "score", "delta-NLL", "worst window",
      "agreement (%)", "first divergence"].map(function (h, i) { return el("th", {cls: i === 0 ? "text" : "", text: h}); }));
    var table = el("table", {id: "samples-table"}, [el("thead", null, [head]), el("tbody", null, rows)]);
    var box = clear(document.getElementById("samples"));
    box.appendChild(el("div", {cls: "scroll", style: "max-height: 260px; overflow-y: auto"}, [table]));
    if (list.length) { box.appendChild(sampleDetail(list[sampleState.index])); }
  }

  function tokenSpans(pieces, div, deltas, side) {
    var out = [];
    var scale = 2.0;
    pieces.forEach(function (p, i) {
      var cls = "tok";
      if (div !== null && div !== undefined && i === div) { cls += " div"; }
      if (side === "policy" && div !== null && div !== undefined && i > div) { cls += " after"; }
      var span = el("span", {cls: cls, text: p});
      var title = "token " + i;
      if (deltas && i < deltas.length) {
        var d = deltas[i];
        var a = Math.min(0.85, Math.abs(d) / scale * 0.85);
        span.style.background = d >= 0 ? "rgba(220,50,40," + a.toFixed(3) + ")" : "rgba(40,90,220," + a.toFixed(3) + ")";
        title += ": delta-NLL " + d.toFixed(3) + " nats";
      }
      span.title = title;
      if (div !== null && div !== undefined && i === div) { out.push(el("span", {cls: "divmark", text: "\u25b6"})); }
      out.push(span);
    });
    return out;
  }

  function sampleDetail(s) {
    var run = RUNS[sampleState.run];
    var ref = s.ref ? DATA.references[s.ref] : null;
    var wrap = el("div");
    var meta = [];
    if (s.meta && s.meta.context_length !== undefined) {
      meta.push("NIAH cell: length " + s.meta.context_length + ", depth " + s.meta.depth_percent + "%");
    }
    if (s.gold !== null && s.gold !== undefined) { meta.push("gold: " + s.gold); }
    if (s.extracted !== null && s.extracted !== undefined) { meta.push("extracted: " + s.extracted); }
    var ev = Object.keys(s.events || {}).map(function (k) { return k + " " + s.events[k]; }).join(", ");
    if (ev) { meta.push("events: " + ev); }
    wrap.appendChild(el("p", {cls: "small", text: meta.join(" \u00b7 ")}));
    wrap.appendChild(el("div", {cls: "legend"}, [
      el("span", null, [el("span", {cls: "divmark", text: "\u25b6 "}), "first divergence from FullKV"]),
      el("span", null, [el("span", {cls: "grad"}), " forced pass: delta-NLL per reference token, 0 to \u2265 2 nats (blue: the policy is more confident than FullKV)"]),
      el("span", null, [el("span", {cls: "tokens tok after", text: "purple"}), ": the policy's tokens after the divergence"])]));
    var left = el("div", {cls: "pane"}, [el("h4", {text: "FullKV reference continuation" +
      (s.deltas ? " (shaded by the policy's forced-pass delta-NLL)" : run.policy === "full" ? "" : " (no per-token delta-NLL recorded for this run)")})]);
    if (ref) {
      left.appendChild(el("div", {cls: "tokens"}, tokenSpans(ref.pieces, s.div, s.deltas, "ref")));
    } else {
      left.appendChild(el("p", {cls: "empty", text: "No FullKV reference recorded for this sample."}));
    }
    var right = el("div", {cls: "pane"}, [el("h4", {text: run.name + "'s free generation"})]);
    if (s.pieces) {
      right.appendChild(el("div", {cls: "tokens"}, tokenSpans(s.pieces, s.div, null, "policy")));
    } else {
      right.appendChild(el("div", {cls: "tokens"}, textWithDivergence(s.output || "", ref, s.div)));
      if (s.output_cut) {
        right.appendChild(el("p", {cls: "small", text: "The output goes on for " + s.output_cut + " more characters, not embedded in this page."}));
      }
      right.appendChild(el("p", {cls: "small", text: "Token ids were not recorded for this run (no traces.jsonl): the text is shown, the divergence placed after the reference's first " + (s.div === null ? "-" : s.div) + " tokens."}));
    }
    wrap.appendChild(el("div", {cls: "pair"}, [left, right]));
    return wrap;
  }

  function textWithDivergence(text, ref, div) {
    if (!ref || div === null || div === undefined) { return [text]; }
    var prefix = ref.pieces.slice(0, div).join("");
    if (text.indexOf(prefix) !== 0) { return [text]; }
    return [prefix, el("span", {cls: "divmark", text: "\u25b6"}), el("span", {cls: "tok after", text: text.slice(prefix.length)})];
  }

  /* ---------------------------------------------------------------- NIAH */
  var niahState = {grid: 0, run: null, key: null, comp: 0};

  function renderNiah() {
    var box = document.getElementById("niah");
    if (!DATA.niah.length) { box.appendChild(el("p", {cls: "empty", text: "No NIAH runs in these results."})); return; }
    DATA.niah.forEach(function (g, gi) {
      var lengths = uniq(g.cells.map(function (c) { return c[0]; }));
      var top = el("tr", null, [el("th", {cls: "text", text: "context length (tokens) \u2192", rowspan: "1"})].concat(lengths.map(function (n) {
        var span = g.cells.filter(function (c) { return c[0] === n; }).length;
        return el("th", {colspan: String(span), style: "text-align:center", text: String(n)});
      })).concat([el("th", {text: ""})]));
      var head = el("tr", null, [el("th", {cls: "text", text: "policy \u2193 / needle depth \u2192"})].concat(g.cells.map(function (c) {
        return el("th", {text: c[1] + "%", title: "context length " + c[0] + " tokens, needle depth " + c[1] + "%"});
      })).concat([el("th", {text: "mean score", title: "mean retrieval score (partial credit), not pass@1"})]));
      var rows = g.rows.map(function (row) {
        var total = 0, count = 0;
        var tds = g.cells.map(function (c) {
          var cell = row.cells[c[0] + "|" + c[1]];
          if (!cell) { return el("td", {cls: "cell nodata", text: "-"}); }
          total += cell.score; count += 1;
          var hasKept = DATA.kept[row.run] && DATA.kept[row.run][cell.keys[0][0] + "|" + cell.keys[0][1]];
          var td = el("td", {cls: "cell" + (hasKept ? " haskept" : ""), text: fmt(cell.score, 2),
            title: row.label + " at L" + c[0] + " D" + c[1] + "%: retrieval score (partial credit) " + fmt(cell.score, 3) +
              (hasKept ? " (click: kept positions)" : " (no kept-position trace)"),
            onclick: function () { selectNiah(gi, row.run, cell.keys[0]); }});
          td.style.background = scoreColor(cell.score);
          td.setAttribute("data-run", row.run);
          td.setAttribute("data-key", cell.keys[0][0] + "|" + cell.keys[0][1]);
          return td;
        });
        return el("tr", null, [el("td", {cls: "text", text: row.label})].concat(tds)
          .concat([el("td", {text: count ? fmt(total / count, 2) : "-"})]));
      });
      box.appendChild(el("h3", {text: g.title || (g.model + " / " + g.task)}));
      box.appendChild(el("div", {cls: "scroll"}, [el("table", {cls: "niah", id: "niah-grid-" + gi},
        [el("thead", null, [top, head]), el("tbody", null, rows)])]));
      box.appendChild(el("div", {cls: "kept-wrap", id: "kept-" + gi}));
    });
    var first = null;
    DATA.niah.forEach(function (g, gi) {
      g.rows.forEach(function (row) {
        Object.keys(row.cells).forEach(function (k) {
          var key = row.cells[k].keys[0];
          if (!first && !row.full && DATA.kept[row.run] && DATA.kept[row.run][key[0] + "|" + key[1]]) {
            first = [gi, row.run, key];
          }
        });
      });
    });
    if (first) { selectNiah(first[0], first[1], first[2]); }
    else {
      document.getElementById("kept-0").appendChild(el("p", {cls: "empty",
        text: "No kept-position traces in these runs: run kvarena eval with --trace-kept to see which prompt positions each layer and KV head kept."}));
    }
  }

  function selectNiah(gi, run, key) {
    niahState = {grid: gi, run: run, key: key[0] + "|" + key[1], comp: 0};
    Array.prototype.forEach.call(document.querySelectorAll("table.niah td.cell"), function (td) {
      td.classList.toggle("sel", td.getAttribute("data-run") === run && td.getAttribute("data-key") === niahState.key);
    });
    renderKept();
  }

  function renderKept() {
    DATA.niah.forEach(function (g, gi) { if (gi !== niahState.grid) { clear(document.getElementById("kept-" + gi)); } });
    var box = clear(document.getElementById("kept-" + niahState.grid));
    var run = RUNS[niahState.run];
    var entry = DATA.kept[niahState.run] && DATA.kept[niahState.run][niahState.key];
    box.appendChild(el("h3", {text: "Kept positions: " + run.name + ", " + niahState.key.replace("|", " sample ")}));
    if (!entry) {
      box.appendChild(el("p", {cls: "empty", text: run.policy === "full" ? "FullKV keeps every position." :
        "No kept-position trace for this run and sample (run kvarena eval with --trace-kept)."}));
      return;
    }
    var comps = entry.compactions;
    var sel = el("select", {id: "kept-comp", onchange: function () { niahState.comp = Number(this.value); renderKept(); }},
      comps.map(function (c, i) {
        var phys = c.physical ? ": " + c.physical[0] + " \u2192 " + c.physical[1] + " slots" : "";
        return option(String(i), (i + 1) + ". " + (c.action || "compaction") + (c.trigger ? " (" + c.trigger + ")" : "") +
          (c.step === null || c.step === undefined ? "" : " at output step " + c.step) + phys, i === niahState.comp);
      }));
    box.appendChild(el("div", {cls: "controls"}, [el("label", null, ["compaction ", sel])]));
    var c = comps[niahState.comp];
    var needle = entry.spans && entry.spans.needle;
    var L = c.shape[0], H = c.shape[1], n = c.n, rows = L * H;
    var bit = bitsOf(c);
    var margin = 46, top = 14, rh = Math.max(2, Math.min(18, Math.floor(420 / rows)));
    var cw = Math.max(1, Math.floor(1100 / n));
    var canvas = el("canvas", {id: "kept-canvas", width: String(margin + n * cw), height: String(top + rows * rh + 2)});
    var ctx = canvas.getContext("2d");
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    var prompt = entry.prompt_tokens || n;
    var inNeedle = function (p) { return needle && p >= needle[0] && p < needle[1]; };
    for (var r = 0; r < rows; r++) {
      for (var p = 0; p < n; p++) {
        var kept = bit(r, p);
        ctx.fillStyle = inNeedle(p) ? (kept ? "#e07000" : "#fbe3c8") :
          kept ? (p < prompt ? "#2f5fb3" : "#6a4c93") : (p < prompt ? "#e6e9ef" : "#efe8f5");
        ctx.fillRect(margin + p * cw, top + r * rh, cw, rh - (rh > 2 && (r % H === H - 1) ? 1 : 0));
      }
    }
    ctx.fillStyle = "#1d2330"; ctx.font = "10px sans-serif";
    var step = Math.max(1, Math.ceil(L / 10));
    for (var l = 0; l < L; l += step) { ctx.fillText("L" + l, 4, top + (l * H + H / 2) * rh + 3); }
    if (needle) {
      ctx.fillStyle = "#e07000";
      ctx.fillRect(margin + needle[0] * cw, 2, Math.max(2, (needle[1] - needle[0]) * cw), top - 5);
    }
    if (prompt < n) {
      ctx.fillStyle = "#6a4c93";
      ctx.fillRect(margin + prompt * cw, 2, 1, top - 4 + rows * rh);
    }
    box.appendChild(el("div", {cls: "scroll"}, [canvas]));
    box.appendChild(el("div", {cls: "legend"}, [
      el("span", null, [el("span", {cls: "swatch", style: "background:#2f5fb3"}), "kept prompt position"]),
      el("span", null, [el("span", {cls: "swatch", style: "background:#e6e9ef"}), "evicted"]),
      el("span", null, [el("span", {cls: "swatch", style: "background:#6a4c93"}), "kept generated position"]),
      el("span", null, [el("span", {cls: "swatch", style: "background:#e07000"}), "kept needle position"]),
      el("span", null, [el("span", {cls: "swatch", style: "background:#fbe3c8"}), "evicted needle position"]),
      el("span", null, ["rows: " + L + " layers \u00d7 " + H + " KV heads (layer 0 at the top); columns: the " + n + " positions that existed (prompt " + prompt + ")"])]));
    var lo = n, hi = 0;
    for (var r0 = 0; r0 < rows; r0++) {
      var kr = 0;
      for (var p0 = 0; p0 < n; p0++) { kr += bit(r0, p0); }
      lo = Math.min(lo, kr); hi = Math.max(hi, kr);
    }
    var summary = (lo === hi ? "Each head keeps " + hi : "Heads keep " + lo + " to " + hi) + " of " + n + " positions.";
    if (needle) {
      var full = 0, part = 0, none = 0, len = needle[1] - needle[0];
      for (var rr = 0; rr < rows; rr++) {
        var k = 0;
        for (var q = needle[0]; q < needle[1]; q++) { k += bit(rr, q); }
        if (k === len) { full++; } else if (k > 0) { part++; } else { none++; }
      }
      summary += " The needle (tokens " + needle[0] + "\u2013" + (needle[1] - 1) + ", " + len + " tokens) is kept whole by " +
        full + " of " + rows + " heads, in part by " + part + ", not at all by " + none + ".";
    } else {
      summary += " No needle span was recorded for this sample.";
    }
    box.appendChild(el("p", {id: "kept-summary", text: summary}));
  }

  /* ---------------------------------------------------------------- capacity */
  var capState = {group: null, request: null, hidden: {}};

  function renderCapacityControls() {
    var groups = Object.keys(DATA.capacity);
    var box = document.getElementById("capacity");
    if (!groups.length) {
      box.appendChild(el("p", {cls: "empty", text: "No capacity traces in these runs (traces.jsonl is written by eval runs since it was added)."}));
      return;
    }
    capState.group = groups.filter(function (g) { return DATA.capacity[g].task !== "niah"; })[0] || groups[0];
    var gsel = el("select", {id: "cap-group", onchange: function () {
      capState.group = this.value; capState.request = null; renderCapacity();
    }}, groups.map(function (g) { return option(g, DATA.capacity[g].title || g, g === capState.group); }));
    document.getElementById("capacity-controls").appendChild(el("label", null, ["task ", gsel]));
    document.getElementById("capacity-controls").appendChild(el("label", {id: "cap-request-label"}));
    renderCapacity();
  }

  var MARKS = {
    grow: {shape: "up", color: "#1e7d32", text: "Grow (one page)"},
    compress: {shape: "circle", color: "#e09f3e", text: "Compress & Hold / compress at the budget"},
    shrink: {shape: "down", color: "#6a4c93", text: "Shrink"},
    fallback: {shape: "cross", color: "#b3261e", text: "fallback (grow refused: compressed instead)"},
    prefill: {shape: "diamond", color: "#3d405b", text: "prompt compression"},
    periodic: {shape: "tick", color: "#00798c", text: "periodic firing (Kara window)"},
    preempt: {shape: "bar", color: "#b3261e", text: "preemption"}
  };

  function markKind(e) {
    if (e.action === "preempt") { return "preempt"; }
    if (e.fallback) { return "fallback"; }
    if (e.trigger === "prefill") { return "prefill"; }
    if (e.trigger === "periodic") { return "periodic"; }
    if (e.action === "grow" || e.action === "compress" || e.action === "shrink") { return e.action; }
    return null;
  }

  function marker(kind, x, y, color, title) {
    var m = MARKS[kind], g = svg("g");
    var c = color || m.color;
    if (m.shape === "up") { g.appendChild(svg("path", {d: "M" + x + " " + (y - 6) + " l5 9 l-10 0 z", fill: c})); }
    else if (m.shape === "down") { g.appendChild(svg("path", {d: "M" + x + " " + (y + 6) + " l5 -9 l-10 0 z", fill: c})); }
    else if (m.shape === "circle") { g.appendChild(svg("circle", {cx: x, cy: y, r: 4, fill: "#fff", stroke: c, "stroke-width": 2})); }
    else if (m.shape === "cross") { g.appendChild(svg("path", {d: "M" + (x - 5) + " " + (y - 5) + " l10 10 m0 -10 l-10 10", stroke: c, "stroke-width": 2.5})); }
    else if (m.shape === "diamond") { g.appendChild(svg("path", {d: "M" + x + " " + (y - 6) + " l6 6 l-6 6 l-6 -6 z", fill: c})); }
    else if (m.shape === "tick") { g.appendChild(svg("rect", {x: x - 2, y: y - 2, width: 5, height: 5, fill: c})); }
    g.appendChild(svgTitle(title));
    return g;
  }

  /* The shown series grouped by their capacity curve: runs whose curves are identical step for
     step form one group (in drawing order), so that they can be told apart on the one line. */
  function sharedLines(shown) {
    var groups = {}, order = [];
    shown.forEach(function (x) {
      if (!x.cap.length) { return; }
      var key = x.cap.join(",");
      if (!groups[key]) { groups[key] = []; order.push(key); }
      groups[key].push(x);
    });
    return order.map(function (k) { return groups[k]; });
  }
  var SHARED_DASH = 10;  /* px of each run's turn on a line it shares */

  function renderCapacity() {
    var group = DATA.capacity[capState.group];
    var reqs = group.requests;
    if (!capState.request || reqs.indexOf(capState.request) < 0) { capState.request = reqs[0]; }
    var label = clear(document.getElementById("cap-request-label"));
    label.appendChild(document.createTextNode("request "));
    label.appendChild(el("select", {id: "cap-request", onchange: function () { capState.request = this.value; renderCapacity(); }},
      reqs.map(function (r) { return option(r, r.replace("|", " sample "), r === capState.request); })));
    var ids = Object.keys(group.runs);
    var series = ids.map(function (id) { return {id: id, s: group.runs[id][capState.request]}; })
      .filter(function (x) { return x.s; });
    var box = clear(document.getElementById("capacity"));
    var chips = el("div", {cls: "chips"}, series.map(function (x) {
      var cb = el("input", {type: "checkbox", onchange: function () { capState.hidden[x.id] = !this.checked; renderCapacity(); }});
      cb.checked = !capState.hidden[x.id];
      return el("label", null, [cb, el("span", {cls: "swatch", style: "background:" + runColor(x.id)}), RUNS[x.id].name]);
    }));
    box.appendChild(chips);
    var shown = series.filter(function (x) { return !capState.hidden[x.id]; });
    var W = 1100, H = 340, ml = 56, mr = 16, mt = 12, firingRows = shown.filter(function (x) {
      return x.s.events.some(function (e) { return markKind(e) === "periodic"; });
    });
    var band = 16 * firingRows.length, mb = 40 + band;
    var maxX = 1, maxY = 1;
    shown.forEach(function (x) {
      var cap = expandRuns(x.s.capacity);
      maxX = Math.max(maxX, cap.length, x.s.output_tokens);
      cap.forEach(function (v) { maxY = Math.max(maxY, v); });
      x.s.events.forEach(function (e) { maxY = Math.max(maxY, e.physical[0], e.physical[1]); maxX = Math.max(maxX, e.step); });
      x.cap = cap;
    });
    var stepY = niceStep(maxY * 1.05), stepX = niceStep(maxX);
    maxY = Math.ceil(maxY * 1.05 / stepY) * stepY;
    maxX = Math.ceil(maxX / stepX) * stepX;
    var sx = function (v) { return ml + (W - ml - mr) * Math.max(0, v) / maxX; };
    var sy = function (v) { return mt + (H - mt - mb) * (1 - v / maxY); };
    var root = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, id: "capacity-chart"});
    var axis = svg("g", {"class": "axis"});
    axis.appendChild(svg("line", {x1: ml, y1: sy(0), x2: W - mr, y2: sy(0)}));
    axis.appendChild(svg("line", {x1: ml, y1: mt, x2: ml, y2: sy(0)}));
    for (var yv = 0; yv <= maxY; yv += stepY) {
      var ty = svg("text", {x: ml - 6, y: sy(yv) + 4, "text-anchor": "end"}); ty.textContent = String(yv); axis.appendChild(ty);
      axis.appendChild(svg("line", {x1: ml - 3, y1: sy(yv), x2: ml, y2: sy(yv)}));
    }
    for (var xv = 0; xv <= maxX; xv += stepX) {
      var tx = svg("text", {x: sx(xv), y: sy(0) + 14, "text-anchor": "middle"}); tx.textContent = String(xv); axis.appendChild(tx);
      axis.appendChild(svg("line", {x1: sx(xv), y1: sy(0), x2: sx(xv), y2: sy(0) + 3}));
    }
    var xl = svg("text", {x: (ml + W - mr) / 2, y: sy(0) + 28, "text-anchor": "middle"}); xl.textContent = "decode step (output token)"; axis.appendChild(xl);
    var yl = svg("text", {x: 12, y: (mt + sy(0)) / 2, transform: "rotate(-90 12 " + ((mt + sy(0)) / 2) + ")", "text-anchor": "middle"});
    yl.textContent = "KV slots allocated"; axis.appendChild(yl);
    root.appendChild(axis);
    var lines = sharedLines(shown);
    lines.forEach(function (members, li) {
      var names = members.map(function (x) { return RUNS[x.id].name; });
      members.forEach(function (x, j) {
        var d = "M" + sx(0) + " " + sy(x.cap[0]);
        x.cap.forEach(function (v, k) { d += " L" + sx(k) + " " + sy(v) + " L" + sx(k + 1) + " " + sy(v); });
        /* Later lines are drawn thinner, so lines that coincide for a while (FullKV and a policy
           before its first compression) stay visible as nested strokes. Runs whose whole curves
           are identical share one line in turns: each draws dashes of SHARED_DASH px, with gaps
           where the others draw theirs, so every run's colour shows along the whole line and
           no value is moved. */
        var attrs = {d: d, fill: "none", stroke: runColor(x.id), "stroke-width": Math.max(1.2, 5 - 1.3 * li),
          "stroke-linejoin": "round", opacity: 0.9, "data-run": x.id};
        var title = RUNS[x.id].name + ": allocated slots per decode step";
        if (members.length > 1) {
          attrs["stroke-dasharray"] = SHARED_DASH + " " + SHARED_DASH * (members.length - 1);
          attrs["stroke-dashoffset"] = SHARED_DASH * ((members.length - j) % members.length);
          title += " (one line shared by " + members.length + " runs: " + names.join(", ") + ")";
        }
        root.appendChild(svg("path", attrs, [svgTitle(title)]));
      });
    });
    shown.forEach(function (x, si) {
      var color = runColor(x.id);
      var fr = firingRows.indexOf(x);
      x.s.events.forEach(function (e) {
        var kind = markKind(e);
        if (!kind) { return; }
        var info = Object.keys(e.info || {}).map(function (k) { return k + "=" + JSON.stringify(e.info[k]); }).join(" ");
        var title = RUNS[x.id].name + ": " + e.action + " (" + e.trigger + (e.fallback ? ", fallback" : "") + ") at step " +
          e.step + ", slots " + e.physical[0] + " \u2192 " + e.physical[1] + ", pages " + e.pages[0] + " \u2192 " + e.pages[1] + (info ? "\n" + info : "");
        var xs = sx(e.step);
        if (kind === "preempt") {
          root.appendChild(svg("line", {x1: xs, y1: mt, x2: xs, y2: sy(0), stroke: MARKS.preempt.color, "stroke-dasharray": "4 3"}, [svgTitle(title)]));
        } else if (kind === "periodic") {
          var yb = sy(0) + 40 + 16 * fr + 6;
          root.appendChild(svg("line", {x1: xs, y1: sy(e.physical[0]), x2: xs, y2: sy(e.physical[1]), stroke: color, "stroke-width": 1, opacity: 0.6}));
          root.appendChild(marker("periodic", xs, yb, color, title));
        } else {
          var at = x.cap.length ? x.cap[Math.min(x.cap.length - 1, Math.max(0, e.step))] : e.physical[1];
          root.appendChild(marker(kind, xs, sy(at), null, title));
        }
      });
      if (fr >= 0) {
        /* A short label in the run's colour (the chips above name the run); hover names it too. */
        var t = svg("text", {x: ml - 6, y: sy(0) + 40 + 16 * fr + 10, "text-anchor": "end", style: "fill:" + color},
          [svgTitle(RUNS[x.id].name + ": periodic firings")]);
        t.appendChild(document.createTextNode("firings"));
        root.appendChild(t);
        root.appendChild(svg("line", {x1: ml, y1: sy(0) + 40 + 16 * fr + 6, x2: sx(maxX), y2: sy(0) + 40 + 16 * fr + 6,
          stroke: color, opacity: 0.25}));
      }
      return si;
    });
    if (!shown.length) {
      var none = svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}); none.textContent = "no series shown"; root.appendChild(none);
    }
    box.appendChild(el("div", {cls: "scroll"}, [root]));
    lines.filter(function (members) { return members.length > 1; }).forEach(function (members) {
      box.appendChild(el("div", {cls: "small shared-line", text: members.length + " runs share this line " +
        "(identical allocations at every step; drawn in turns, dashes of each run's colour): " +
        members.map(function (x) { return RUNS[x.id].name; }).join(", ")}));
    });
    box.appendChild(el("div", {cls: "legend"}, Object.keys(MARKS).map(function (k) {
      var s = svg("svg", {width: 16, height: 16});
      if (k === "preempt") { s.appendChild(svg("line", {x1: 8, y1: 0, x2: 8, y2: 16, stroke: MARKS[k].color, "stroke-dasharray": "3 2"})); }
      else { s.appendChild(marker(k, 8, 8, null, MARKS[k].text)); }
      return el("span", null, [s, " " + MARKS[k].text]);
    }).concat([el("span", {text: "Lines: allocated slots (pages \u00d7 block size) after each decode step; each decision sits on its policy's line at the step it was taken (hover: slots and pages before \u2192 after)."})])));
  }

  /* ---------------------------------------------------------------- config and provenance */
  function renderProvenance() {
    var box = document.getElementById("provenance");
    var head = el("tr", null, [el("th", {cls: "text", text: "prov"}), el("th", {cls: "text", text: "code and machine"}), el("th", {text: "runs"})]);
    box.appendChild(el("table", {id: "provenance-table"}, [el("thead", null, [head]), el("tbody", null, DATA.provenance.map(function (p) {
      return el("tr", null, [el("td", {cls: "text", text: p.letter}), el("td", {cls: "text", text: p.description}), el("td", {text: String(p.runs)})]);
    }))]));
    if (DATA.provenance.length > 1) {
      box.appendChild(el("p", {cls: "help", text: "Rows whose prov letters differ were produced by different code or machines: a difference between them is not the policies' alone."}));
    }
    var runs = el("div", {id: "configs"});
    DATA.runs.forEach(function (r) {
      var prov = r.config.provenance || {};
      var summary = r.model + " / " + r.task + " / " + r.name + "  (prov " + r.prov + (prov.command ? "; " + prov.command : "") + ")";
      runs.appendChild(el("details", null, [el("summary", {text: summary}),
        el("pre", {cls: "config", text: JSON.stringify(r.config, null, 2)})]));
    });
    box.appendChild(el("h3", {text: "Each run's config.json"}));
    box.appendChild(runs);
  }

  // The figures are matplotlib's own SVG (evals/report/data.py figures_section), shown as drawn.
  function renderFigures() {
    var box = document.getElementById("figures");
    var figures = DATA.figures || [];
    if (!figures.length) { box.appendChild(el("p", {cls: "empty", text: "No run has fidelity figures (runs with --no-fidelity, or none besides FullKV)."})); return; }
    figures.forEach(function (f) {
      var holder = el("div", {cls: "figure"});
      holder.innerHTML = f.svg;
      box.appendChild(el("h3", {text: f.title}));
      box.appendChild(el("div", {cls: "scroll"}, [holder]));
    });
  }

  renderHeader();
  renderBoardControls();
  renderBoard();
  renderFigures();
  renderSamplesControls();
  renderNiah();
  renderCapacityControls();
  renderProvenance();
  document.body.setAttribute("data-rendered", "yes");
})();
