"""Fidelity to FullKV: how far a policy's decoding drifts from the uncompressed model's, per sample.

Accuracy on a small model is often 0% for every policy, so it cannot rank them; drift from FullKV
can. For each (problem, sample) of an eval run:

1. **Reference.** FullKV's free generation for the same prompt, seed and max_tokens (greedy or
   sampled: sample ``j`` uses seed ``seed + j`` as in the run), with the log-probability of every
   token. It is generated once per model, task and generation settings, cached in the results
   tree and reused by every policy (see *Cache* below). A FullKV run writes the entries it
   generates itself, so FullKV never costs a second pass.
2. **Forced pass.** The policy decodes the reference teacher-forced (``SamplingParams.
   forced_tokens``, ``ignore_eos`` so a reference ending with EOS is scored to its end) and makes
   its own compression decisions on the way: prompt compression, boundaries, periodic firings.
   Per token ``t``: ``d_t = -log p_policy(ref_t) - (-log p_full(ref_t))`` (raw logits, i.e. the
   model's distribution at temperature 1, for greedy and sampled runs alike).
3. **Free generation.** The run's own output is compared with the reference position by position.

Per-sample fields written into every line of ``samples.jsonl`` (None where not applicable: a
failed sample, a run with ``--no-fidelity``):

- ``fid_delta_nll``: mean of ``d_t`` over the reference (nats/token; 0 = FullKV's likelihood);
- ``fid_worst_window``: the largest mean of ``d_t`` over a window of ``WINDOW`` = 32 consecutive
  tokens (the whole reference when shorter): drift concentrated after one bad eviction shows
  here even when the mean is small;
- ``fid_first_divergence``: the first output position (from 0) where the free generation differs
  from the reference, or where one of them ended; None when they are identical;
- ``fid_agreement``: share of the reference's positions where the free generation has the same
  token (a shorter generation disagrees on the positions it lacks);
- ``fid_ref_tokens``: the reference's length.

FullKV's own rows are exact by construction: its forced log-likelihood of its own reference *is*
the reference's (no forced pass is run, ``fid_delta_nll`` = 0.0 exactly), and where the run
generated the reference entry itself, that entry is its own output (agreement 1, no divergence).
When the reference came from an earlier pass, FullKV's free generation is still compared token
by token, so a non-deterministic backend would show.

Cost: the reference costs one FullKV generation per sample, once per model, task and settings;
the forced pass costs one prefill plus one decode step per reference token for every policy but
FullKV (about one extra pass per sample). Each invocation's wall times go to
``fidelity_passes.jsonl`` in the run directory.

A request that forces its own continuation (a task's token request: evals.tasks.longdoc) is
its own forced pass: its reference is FullKV's forced pass over the same tokens (plus FullKV's
free answer where the request asks for one), ``d_t`` runs over the forced tokens, and agreement
and first divergence compare the free answers (None without one). FullKV's run writes its own
log-probabilities too, so every run of such a task has the per-token NLL of every document.

Per-token log-probabilities of the forced pass go to ``forced_logprobs.jsonl`` in the run
directory (one line per sample and invocation: ``uid``, ``sample``, ``prompt_sha``, ``segment``,
``n`` and ``lp``, base64 of ``n`` little-endian float32), so ``kvarena report`` can shade each
reference token by its ``d_t`` (:func:`token_deltas`); the last line of a sample wins.

Cache::

    <out>/<model>/<task>/_reference/<key>/
        key.json          the settings the key is a hash of
        reference.jsonl   one entry per (uid, sample, prompt hash), appended as they finish
        .lock             held while an invocation generates missing entries (its holder inside)

``<key>`` = ``mt<max_tokens>-T<temperature>-s<seed>-<hash>``, the hash covering the model, the
task and its options, the data source, max_tokens, temperature, seed and the thinking switch.
Each entry also carries a hash of the rendered prompt's token ids, so a changed chat template or
tokenizer misses the cache instead of reusing a wrong reference. Resume: entries already there
are kept; only missing ones are generated. Invocations running at once on one ``--out`` share
the directory: one generates the missing entries while holding its lock (``.lock`` there), the
others wait, then reuse them; a key gets one line whoever writes it (``Reference``).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import numpy as np

from evals import results as R
from evals.jsonio import FILE_MODE, dumps_line, set_mode, write_json
from evals.results.labels import model_slug, slug
from evals.results.lock import holder, read_holder
from evals.run import engines
from evals.run.progress import track
from evals.run.prompts import prompt_hash

WINDOW = 32
REFERENCE_DIR = "_reference"
REFERENCE_FILE = "reference.jsonl"
KEY_FILE = "key.json"
PASSES_FILE = "fidelity_passes.jsonl"
FORCED_FILE = "forced_logprobs.jsonl"
FULL_POLICY = "full"

# The per-sample fields. evals.results.metrics puts the mean of each (over the samples where it is not
# None) and its 95% interval into metrics.json; fid_first_divergence's mean is thus over the
# samples that diverged.
FIELDS = ("fid_delta_nll", "fid_worst_window", "fid_first_divergence", "fid_agreement",
          "fid_ref_tokens")


def empty_fields() -> dict:
    """The fidelity fields of a sample that has none (failed sample, fidelity off)."""
    return {k: None for k in FIELDS}


# ------------------------------------------------------------------------------ statistics


def delta_nll(policy_logprobs: Sequence[float], full_logprobs: Sequence[float]) -> list[float]:
    """Per-token ``-log p_policy + log p_full`` over the positions both scored.
    policy_logprobs: [n_policy], full_logprobs: [n_ref] -> [min(n_policy, n_ref)]."""
    n = min(len(policy_logprobs), len(full_logprobs))
    return [float(full_logprobs[i]) - float(policy_logprobs[i]) for i in range(n)]


def worst_window(deltas: Sequence[float], window: int = WINDOW) -> float | None:
    """Max over every run of ``window`` consecutive values (stride 1) of its mean; the mean of all
    values when there are fewer. deltas: [n] -> scalar (None when n = 0)."""
    n = len(deltas)
    if n == 0:
        return None
    if n <= window:
        return float(np.mean(deltas))
    c = np.concatenate([[0.0], np.cumsum(np.asarray(deltas, dtype=np.float64))])
    return float(((c[window:] - c[:-window]) / window).max())


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """First position where ``tokens`` differs from ``reference`` or one of them has ended; None
    when they are identical."""
    n = min(len(tokens), len(reference))
    for i in range(n):
        if tokens[i] != reference[i]:
            return i
    return None if len(tokens) == len(reference) else n


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the reference's positions where ``tokens`` has the same token."""
    if not reference:
        raise ValueError("agreement needs a non-empty reference")
    same = sum(1 for a, b in zip(tokens, reference) if a == b)
    return same / len(reference)


def sample_fields(ref: Mapping[str, Any], tokens: Sequence[int],
                  forced_logprobs: Sequence[float] | None) -> dict:
    """The per-sample fields from a reference entry, the free generation's tokens and the forced
    pass's log-probabilities (None for FullKV, whose forced likelihood is the reference's)."""
    ref_tokens, ref_lp = ref["tokens"], ref["logprobs"]
    if forced_logprobs is None:
        deltas = [0.0] * len(ref_tokens)
    else:
        deltas = delta_nll(forced_logprobs, ref_lp)
    return {
        "fid_delta_nll": float(np.mean(deltas)) if deltas else None,
        "fid_worst_window": worst_window(deltas),
        "fid_first_divergence": first_divergence(list(tokens), ref_tokens),
        "fid_agreement": agreement(list(tokens), ref_tokens),
        "fid_ref_tokens": len(ref_tokens),
    }


# ------------------------------------------------------------------------------ reference cache


def reference_key(config: Mapping[str, Any]) -> tuple[str, dict]:
    """(directory name, the settings it stands for) of a run's reference; ``config`` is the run's
    config.json content."""
    settings = {k: config.get(k) for k in ("model", "model_spec", "task", "task_options",
                                           "data_source", "max_tokens", "temperature", "seed",
                                           "thinking")}
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = slug(f"mt{settings['max_tokens']}-T{float(settings['temperature']):g}-"
                  f"s{settings['seed']}-{digest}")
    return name, settings


@dataclass
class Reference:
    """One reference directory: its entries by (uid, sample, prompt hash).

    Several invocations may share it (two policies evaluated at once on one ``--out``): an entry
    is appended under an exclusive ``flock`` of ``reference.jsonl`` after reading what the others
    appended, so each key has one line, and generating missing entries holds ``generating()``,
    so the second invocation waits and reuses the first one's entries instead of generating
    them again. Both locks die with their process (kill -9 too)."""

    path: Path
    entries: dict
    offset: int = 0  # bytes of reference.jsonl read into ``entries``

    @classmethod
    def open(cls, out: str | Path, config: Mapping[str, Any]) -> "Reference":
        name, settings = reference_key(config)
        path = Path(out) / model_slug(config["model_spec"]) / slug(config["task"]) / REFERENCE_DIR / name
        path.mkdir(parents=True, exist_ok=True)
        if not (path / KEY_FILE).exists():
            write_json(path / KEY_FILE, settings)
        ref = cls(path, {})
        ref.refresh()
        return ref

    def refresh(self) -> None:
        """Read the entries appended since the last read (by any invocation). A last line without
        its newline (being written, or cut by a crash) is left for a later read."""
        try:
            with open(self.path / REFERENCE_FILE, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
                self.entries.setdefault((e["uid"], int(e["sample"]), e["prompt_sha"]), e)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash: that entry is generated again
        self.offset += end

    def get(self, uid: str, sample: int, sha: str) -> dict | None:
        return self.entries.get((uid, sample, sha))

    def add(self, uid: str, sample: int, sha: str, seed: int, out: Any) -> dict:
        """Store a FullKV output (token ids and log-probabilities) as the entry of a sample, unless
        this or another invocation stored one already; returns the entry kept."""
        if len(out.token_logprobs) != len(out.token_ids):
            raise ValueError(f"reference for {uid} sample {sample}: {len(out.token_logprobs)} "
                             f"log-probs for {len(out.token_ids)} tokens (generate with logprobs=True)")
        entry = {"uid": uid, "sample": sample, "prompt_sha": sha, "seed": seed,
                 "tokens": list(out.token_ids), "logprobs": [float(x) for x in out.token_logprobs],
                 "finish_reason": out.finish_reason}
        key = (uid, sample, sha)
        if key in self.entries:
            return self.entries[key]
        fd = os.open(self.path / REFERENCE_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            set_mode(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
            self.refresh()
            if key not in self.entries:
                data = dumps_line(entry).encode("utf-8")
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # a line cut by a crash stays a line of its own
                while data:  # a regular file takes it whole; the loop only guards a short write
                    data = data[os.write(fd, data):]
                self.refresh()
        finally:
            os.close(fd)
        return self.entries.setdefault(key, entry)

    @contextmanager
    def generating(self, on_message: Callable[[str], None]) -> Iterator[None]:
        """Hold the directory's generation lock (``<dir>/.lock``) for the block, waiting for
        another invocation that holds it (``on_message`` says whose). A dead holder holds
        nothing: the kernel releases its lock."""
        fd = os.open(self.path / R.LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                on_message(f"FullKV reference: waiting for another kvarena invocation that is "
                           f"generating it ({read_holder(fd)})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            set_mode(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder()).encode("utf-8") + b"\n", 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)  # no stale holder for the next reader
        finally:
            os.close(fd)  # closing releases the lock


# ------------------------------------------------------------------------------ the passes


@dataclass
class Request:
    """One sample the run generates: its key, prompt ids and sampling parameters."""

    uid: str
    sample: int
    seed: int
    prompt: list
    params: Any  # engine.sampling.SamplingParams

    @property
    def sha(self) -> str:
        return prompt_hash(self.prompt)


class _Prefixed:
    """Forwards the run's hooks' messages with a prefix (engine loads for the reference)."""

    def __init__(self, hooks, prefix: str):
        self.hooks, self.prefix = hooks, prefix

    def on_message(self, text: str) -> None:
        self.hooks.on_message(f"{self.prefix}{text}")


class Fidelity:
    """The fidelity measurement of one invocation of an eval run (see the module docstring).

    Use, around the run's timed generation::

        fid = Fidelity(out, config, policy, policy_args)
        fid.ensure_reference(requests, model, engine_kwargs, hooks)   # before the policy engine loads
        params = fid.run_params(params)                               # FullKV: with log-probs
        fid.forced_pass(llm, requests)                                # the policy's, before timing
        record.update(fid.fields(request, output))                    # per finished request
    """

    def __init__(self, out: str | Path, config: Mapping[str, Any], policy: str,
                 policy_args: Mapping[str, Any]):
        self.reference = Reference.open(out, config)
        self.policy, self.policy_args = policy, dict(policy_args)
        self.is_full = policy == FULL_POLICY
        self.forced: dict[tuple[str, int, str], list[float]] = {}
        self.requests: list[Request] = []  # the invocation's requests, in the run's order
        self.timing = {"reference_requests": 0, "reference_tokens": 0, "reference_s": 0.0,
                       "forced_requests": 0, "forced_tokens": 0, "forced_s": 0.0}

    def missing(self, requests: Sequence[Request]) -> list[Request]:
        return [q for q in requests if self.reference.get(q.uid, q.sample, q.sha) is None]

    # -- reference -------------------------------------------------------------------------------
    def ensure_reference(self, requests: Sequence[Request], model: str, engine_kwargs: Mapping[str, Any],
                         hooks: Any) -> None:
        """Generate the missing reference entries with a FullKV engine, holding the reference's
        generation lock (another invocation generating them is waited for, and its entries
        reused). A FullKV run skips this: its own outputs become the entries (``fields``)."""
        if self.is_full or not self.missing(requests):
            return
        with self.reference.generating(hooks.on_message):
            self.reference.refresh()  # what another invocation generated while this one waited
            todo = self.missing(requests)
            if not todo:
                return
            kwargs = {**engine_kwargs, "policy": FULL_POLICY, "policy_args": {}}
            hooks.on_message(f"FullKV reference: {len(todo)} sample(s) missing in {self.reference.path}")
            llm = engines.engine_for(model, kwargs, _Prefixed(hooks, "FullKV reference: "))
            self.generate_reference(llm, todo, hooks)

    def generate_reference(self, llm, requests: Sequence[Request], hooks: Any = None) -> None:
        """FullKV free generation (with log-probs) of the missing entries; ``llm`` runs FullKV.
        ``hooks.on_progress``, where there is one, sees the pass's token count."""
        if llm.policy.name != FULL_POLICY:
            raise ValueError(f"the reference must be generated by FullKV, not {llm.policy.name!r}")
        # Prompts the engine cannot take are left out (the run records them as failed samples).
        todo = [q for q in self.missing(requests) if not llm.why_unfit(len(q.prompt))]
        if not todo:
            return
        start = time.perf_counter()
        params = [_with_logprobs(q.params) for q in todo]
        progress, on_step = track(hooks, "FullKV reference", params)
        for out in llm.stream([q.prompt for q in todo], params, on_step=on_step):
            progress.finished(out.index, out.num_output_tokens)
            q = todo[out.index]
            self.reference.add(q.uid, q.sample, q.sha, q.seed, out)
            self.timing["reference_tokens"] += out.num_output_tokens
        self.timing["reference_requests"] += len(todo)
        self.timing["reference_s"] += time.perf_counter() - start

    def run_params(self, params: Sequence[Any]) -> list:
        """The run's sampling parameters: a FullKV run records log-probs (its outputs may become
        reference entries); other runs are left as they are, so fidelity never slows the timed
        generation of a policy."""
        return [_with_logprobs(p) for p in params] if self.is_full else list(params)

    # -- forced pass -----------------------------------------------------------------------------
    def forced_pass(self, llm, requests: Sequence[Request], hooks: Any = None) -> None:
        """The policy's teacher-forced decode of each request's reference, on ``llm`` (the run's
        engine) with a fresh policy instance and a fresh prefix cache, both replaced again
        afterwards so the timed run starts as it would without this pass. FullKV needs none.
        ``hooks.on_progress``, where there is one, sees the pass's token count."""
        todo = [q for q in requests if self.reference.get(q.uid, q.sample, q.sha) is not None
                and not q.params.forced_tokens]  # a forced request is its own forced pass
        if self.is_full or not todo:
            return
        from engine.sampling import SamplingParams

        params = []
        for q in todo:
            ref = self.reference.get(q.uid, q.sample, q.sha)["tokens"]
            p = q.params
            # ignore_eos: a reference that ends with EOS is scored up to and including it.
            params.append(SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                         seed=p.seed, max_tokens=len(ref), forced_tokens=tuple(ref),
                                         kv_budget=p.kv_budget, logprobs=True, ignore_eos=True))
        run_policy = llm.policy
        llm.use_policy(self.policy, **self.policy_args)
        start = time.perf_counter()
        progress, on_step = track(hooks, "forced pass", params)
        try:
            for out in llm.stream([q.prompt for q in todo], params, on_step=on_step):
                progress.finished(out.index, out.num_output_tokens)
                q = todo[out.index]
                self.forced[(q.uid, q.sample, q.sha)] = list(out.token_logprobs)
                self.timing["forced_tokens"] += out.num_output_tokens
        finally:
            llm.use_policy(run_policy)
        self.timing["forced_requests"] += len(todo)
        self.timing["forced_s"] += time.perf_counter() - start

    # -- per sample ------------------------------------------------------------------------------
    def fields(self, q: Request, out: Any) -> dict:
        """The per-sample fields of a finished request of the run. A FullKV run stores its own
        output as the reference entry where there is none yet."""
        ref = self.reference.get(q.uid, q.sample, q.sha)
        if ref is None and self.is_full:
            ref = self.reference.add(q.uid, q.sample, q.sha, q.seed, out)
        if ref is None or not ref["tokens"]:
            return empty_fields()
        if q.params.forced_tokens:
            return self._forced_fields(q, ref, out)
        if self.is_full:
            return sample_fields(ref, out.token_ids, None)
        forced = self.forced.get((q.uid, q.sample, q.sha))
        if forced is None:  # the forced pass was not run for it: only the token comparison
            return {**sample_fields(ref, out.token_ids, []), "fid_delta_nll": None,
                    "fid_worst_window": None}
        return sample_fields(ref, out.token_ids, forced)

    def _forced_fields(self, q: Request, ref: Mapping[str, Any], out: Any) -> dict:
        """The fields of a request that forces its own continuation (a long document): the run's
        log-probabilities of the forced tokens are the forced pass (kept for
        ``forced_logprobs.jsonl``), FullKV's forced pass over the same tokens the reference;
        agreement and first divergence compare the free answer after them, if any, with
        FullKV's (None without one)."""
        n = len(q.params.forced_tokens)
        own = [float(x) for x in out.token_logprobs[:n]]
        self.forced[(q.uid, q.sample, q.sha)] = own
        deltas = [0.0] * min(n, len(ref["logprobs"])) if self.is_full else delta_nll(own, ref["logprobs"][:n])
        answer, ref_answer = list(out.token_ids[n:]), ref["tokens"][n:]
        return {
            "fid_delta_nll": float(np.mean(deltas)) if deltas else None,
            "fid_worst_window": worst_window(deltas),
            "fid_first_divergence": (None if not ref_answer else first_divergence(answer, ref_answer)),
            "fid_agreement": agreement(answer, ref_answer) if ref_answer else None,
            "fid_ref_tokens": len(ref["tokens"]),
        }

    def write_forced(self, run_path: Path, segment: int) -> int:
        """Append this invocation's forced-pass log-probabilities to the run's
        ``forced_logprobs.jsonl`` (module docstring); returns the number of lines written."""
        lines = [dumps_line({"uid": uid, "sample": sample, "prompt_sha": sha, "segment": segment,
                               **encode_logprobs(lp)})
                 for (uid, sample, sha), lp in self.forced.items()]
        if lines:
            with open(Path(run_path) / FORCED_FILE, "a", encoding="utf-8") as f:
                f.write("".join(lines))
        return len(lines)

    def write_timing(self, run_path: Path, segment: int) -> dict:
        """Append this invocation's pass times to the run's ``fidelity_passes.jsonl``."""
        line = {"segment": segment, "reference": str(self.reference.path), **self.timing}
        with open(Path(run_path) / PASSES_FILE, "a", encoding="utf-8") as f:
            f.write(dumps_line(line))
        return line


def encode_logprobs(logprobs: Sequence[float]) -> dict:
    """[n] log-probabilities as ``{"n", "lp"}``: base64 of little-endian float32."""
    raw = np.asarray(logprobs, dtype="<f4").tobytes()
    return {"n": len(logprobs), "lp": base64.b64encode(raw).decode("ascii")}


def decode_logprobs(entry: Mapping[str, Any]) -> list[float]:
    """Inverse of :func:`encode_logprobs`."""
    values = np.frombuffer(base64.b64decode(entry["lp"]), dtype="<f4")
    if len(values) != int(entry["n"]):
        raise ValueError(f"forced log-probs: {len(values)} values for n = {entry['n']}")
    return [float(v) for v in values]


def read_forced(run_path: str | Path, keys: Collection[tuple[str, int]] | None = None
                ) -> dict[tuple[str, int], dict]:
    """{(uid, sample): {"prompt_sha", "segment", "logprobs"}} from a run's
    ``forced_logprobs.jsonl`` (the last line of each sample; empty when there is none), only
    those of ``keys`` when given; read line by line, lines cut short by a kill skipped."""
    from evals.traces import iter_json_lines, line_key

    out: dict[tuple[str, int], dict] = {}
    for _, e in iter_json_lines(Path(run_path) / FORCED_FILE):
        key = line_key(e)
        if key is None or (keys is not None and key not in keys):
            continue
        try:
            out[key] = {"prompt_sha": e["prompt_sha"], "segment": e.get("segment"),
                        "logprobs": decode_logprobs(e)}
        except (ValueError, KeyError, TypeError):
            continue
    return out


def reference_entries(run_path: str | Path, config: Mapping[str, Any],
                      keys: Collection[tuple[str, int]] | None = None) -> dict[tuple[str, int], list[dict]]:
    """Read-only view of a run's reference cache (the ``_reference`` directory beside the run's
    own, keyed by its config): {(uid, sample): entries in file order} (several when the prompt
    changed between invocations; they differ in ``prompt_sha``), only those of ``keys`` when
    given. Empty when there is none; read line by line."""
    from evals.traces import iter_json_lines, line_key

    name, _ = reference_key(config)
    file = Path(run_path).parent / REFERENCE_DIR / name / REFERENCE_FILE
    out: dict[tuple[str, int], list[dict]] = {}
    for _, e in iter_json_lines(file):
        key = line_key(e)
        if key is not None and (keys is None or key in keys):
            out.setdefault(key, []).append(e)
    return out


def token_deltas(ref: Mapping[str, Any], forced_logprobs: Sequence[float] | None) -> list[float] | None:
    """Per reference token ``d_t`` (``delta_nll``) of a reference entry and a forced pass's
    log-probabilities; None without a forced pass."""
    if forced_logprobs is None:
        return None
    return delta_nll(forced_logprobs, ref["logprobs"])


def _with_logprobs(params):
    import dataclasses

    return params if params.logprobs else dataclasses.replace(params, logprobs=True)


def requests_for(rendered: Sequence[Any]) -> list[Request]:
    """The run's rendered requests (evals.run.plan.Rendered, from ``render_requests``) as Requests,
    those with their prompt tokenized in full only (a longer one is a failed sample of the run)."""
    return [Request(r.problem.uid, r.sample, r.seed, list(r.ids), r.params)
            for r in rendered if r.ids is not None]


def start(settings, config: Mapping[str, Any], requests: Sequence[Request],
          engine_kwargs: Mapping[str, Any], hooks: Any) -> Fidelity:
    """The fidelity measurement of a run invocation (evals.run.settings.EvalSettings ``settings``),
    with its reference complete for ``requests`` (generated here, before the policy's engine
    loads, unless the run is FullKV's own)."""
    fid = Fidelity(settings.out, config, settings.policy, engine_kwargs["policy_args"])
    if not fid.is_full:
        fid.ensure_reference(requests, settings.model, engine_kwargs, hooks)
    return fid
