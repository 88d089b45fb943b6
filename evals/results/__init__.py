"""Result directories: layout, per-sample JSONL (written as samples finish), resume, metrics.

This package defines the files' names and the errors; its modules own the rest:

    labels.py    run labels, model and task slugs, ``run_dir``
    lines.py     the typed sample and segment lines (``validate_sample``), ungraded / failed samples
    files.py     reading and writing the files: config.json, samples.jsonl (``SampleWriter``),
                 segments.jsonl, progress.json, torn-line repair, writability, file modes
    lock.py      ``RunLock``: one writer per run directory
    identity.py  the settings a resume must match (``IDENTITY``) and the engine settings of segments
    metrics.py   ``compute_metrics``: metrics.json with its intervals
    runs.py      ``find_runs``: the finished runs below a directory, for tables and the report

Layout of one run (one model x task x policy configuration)::

    <out>/<model>/<task>/<label>/
        config.json     every setting of the run (written before the first sample)
        samples.jsonl   one JSON object per finished sample, appended and flushed as it finishes
        segments.jsonl  one line per invocation (a resumed run has several): engine wall time,
                        the samples and output tokens it wrote to samples.jsonl (``lost``: those
                        finished but dropped or not written), run statistics (so far, for an
                        interrupted segment) and the engine settings it ran with (``settings``)
        progress.json   the running segment's line as of its last finished request (rewritten
                        after each); a run killed outright (kill -9) leaves it, and the next
                        invocation appends it to segments.jsonl as a ``killed`` segment with the
                        samples and tokens of its lines, so the totals in metrics.json cover
                        every sample it wrote and none it did not
        metrics.json    the aggregate, rewritten at the end of every invocation
        niah_heatmap.png (task niah only)
        .lock           the advisory lock of the one invocation writing the directory, and who
                        holds it (pid, host, command, start); never deleted (see ``RunLock``)

``<label>`` is the policy name plus the policy arguments given on the command line, sorted,
e.g. ``full``, ``zipage``, ``zipage+budget=256``, ``growpage-shrink+min_capacity=128+tau=0.001``,
plus the fixed KV budget the run uses wherever that is not the task preset's default
(``budget_label_args``): ``--kv-budget 96`` and ``-a budget=96`` both write ``snapkv+budget=96``,
so one label never holds two budgets. Then the generation settings that differ from the task
preset's (``setting_label_args``): ``mt`` max tokens, ``T`` temperature, ``bs`` block size, as in
``snapkv+budget=96+mt=512+T=0``, so trying another length or temperature gets a directory of its
own instead of a refusal to mix. The task preset's own values are not part of the label, so one
policy keeps one label across tasks whose defaults differ (as Zipage's budget does in GrowPage's
Table 1); ``config.json`` holds the values actually used. ``--label NAME`` names the directory
instead. Directories written before the budget or the settings joined the label keep their names
(``evals.run.plan.resolve_target`` resumes them there when they hold the very run asked for).

Resume: a sample is identified by ``(uid, sample index)``. A run that finds ``samples.jsonl``
skips the samples already there. The settings that change what a sample produces (``IDENTITY``)
must match those in ``config.json``; otherwise the run stops with an error rather than mix two
experiments in one file. ``--limit`` and ``--samples`` may change between invocations: metrics
are computed over the samples the current invocation asks for.

One writer per run directory: an invocation holds ``RunLock`` from before its model loads to
its last write; a second one on the same directory stops at once naming the holder. Segment
numbers are unique: a new segment takes one more than any number found in segments.jsonl,
progress.json or a sample line. Every results file is created with one mode (``FILE_MODE``).

A last line cut short by a crash (no trailing newline) of samples.jsonl or segments.jsonl is cut
from the file, with a warning, before anything is appended to it; a line in the middle that is
not JSON is dropped and reported. A line that is JSON but holds what no run writes (a hand edit:
``score: "high"``, ``correct: "no"``, ``stats: "x"``), a config.json that is not a JSON object,
or a results file that is not a regular file stops the run with ``ResultsCorruptError`` naming
the file and line (``validate_sample`` / ``validate_segment``). A sample
recorded twice keeps its first line, unless that line is a failed sample (``status: "failed"``, an
engine reason such as a prompt longer than the pool) or an ungraded one (``ungraded``: grading
itself failed): a failed sample is retried by a resumed run whose engine settings differ from
those of the segment that failed it (or with ``retry_failed``), an ungraded one by every resumed
run, and the retry's line replaces it.

Engine settings (KV pool size, concurrency, pages) may differ between invocations; each segment
records its own, and config.json's ``kv_cache_tokens`` / ``max_num_seqs`` / ``engine`` describe
the samples held only when they all came from one setting -- otherwise they read ``"mixed"`` and
``engine_settings`` lists each setting with its segments and sample counts.
"""

from __future__ import annotations

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"
SEGMENTS_FILE = "segments.jsonl"
METRICS_FILE = "metrics.json"
PROGRESS_FILE = "progress.json"
LOCK_FILE = ".lock"
NIAH_HEATMAP_FILE = "niah_heatmap.png"


class ResultsError(ValueError):
    """A result directory cannot be used as asked; the message names the file and says why."""


class ResultsMismatchError(ResultsError):
    """A result directory holds a run with other settings than the one asked for."""


class RunBusyError(ResultsError):
    """Another invocation holds the run directory's lock (``RunLock``)."""


class ResultsCorruptError(ResultsError):
    """A results file holds what no run writes (a hand edit, a truncated file, a directory)."""


class ResultsWriteError(ResultsError):
    """A results file could not be written; what was written before stays."""


class DataChangedError(ResultsError):
    """The data file of a resumed run is not the one its samples were graded against."""


SampleKey = tuple[str, int]
