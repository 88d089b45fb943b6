"""The engine's decode beside CPU-bound competitors, under each OpenMP thread setup.

    .venv/bin/python scripts/contention_check.py [--contend 1] [--repeats 3] [--tokens 32]
    .venv/bin/python scripts/contention_check.py --share [--repeats 2] [--tokens 128]

Starts `--contend` busy-loop processes, then runs, in alternation, one fresh process per setup:
the embedded model's batch-1 decode (`--tokens` greedy tokens, EOS ignored) and a batch of 16
(half as many tokens each), printing tok/s, process CPU seconds and the 1-minute load before each.

`--share` prints the two ways of sharing the machine against one quiet process, in one run per
repeat and setup: `quiet` (one engine process alone), `pair` (two engine processes side by side,
their tok/s added) and `nice0` (one engine process beside one busy loop at the same priority);
the ratio column is each case's tok/s over the same repeat's quiet tok/s.

Setups: `spin` (torch loaded before the engine could set its OpenMP defaults: libgomp's own
300,000-iteration spin), `passive` (the engine's defaults: named for an earlier default, it now
runs engine/threads.py's bounded spin and thread governor), `passive-1t` (the same on one thread),
`passive-bound` (two threads bound one per CPU, GOMP_CPU_AFFINITY, as vLLM's CPU backend binds
its worker's threads), `python-llm` (an `LLM` made from Python without `set_threads`, as a
script using the engine as a library does). The findings and figures measured with it are in
results/benchmarks/cpu-threads-notes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (threads, extra environment, import torch before engine)
SETUPS = {
    "spin": (2, {}, True),
    "passive": (2, {}, False),
    "passive-1t": (1, {}, False),
    "passive-bound": (2, {"GOMP_CPU_AFFINITY": "0 1"}, False),
    "python-llm": (0, {}, False),
}

CHILD = """
import json, os, sys, time
if {torch_first}:
    import torch  # before engine: the wait policy it sets comes too late for libgomp
from engine.threads import set_threads
from engine.llm import LLM
from engine.sampling import SamplingParams
if {threads}:
    set_threads({threads})
llm = LLM("default", kv_cache_tokens=8192, max_num_seqs=64)
prompt = list(range(100, 164))
llm.generate([prompt[:4]], SamplingParams(temperature=0.0, max_tokens=2))
out = {{}}
for name, n, tokens in (("batch 1", 1, {tokens}), ("batch 16", 16, max(1, {tokens} // 2))):
    load = os.getloadavg()[0]
    t, c = time.perf_counter(), time.process_time()
    llm.generate([[p + i for p in prompt] for i in range(n)],
                 SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    out[name] = {{"tps": n * tokens / wall, "cpu_s": cpu, "load": load}}
print(json.dumps(out))
"""


def start_setup(name: str, tokens: int) -> subprocess.Popen:
    threads, extra, torch_first = SETUPS[name]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra, PYTHONPATH=str(REPO))
    code = CHILD.format(torch_first=torch_first, threads=threads, tokens=tokens)
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"engine process failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_setup(name: str, tokens: int) -> dict:
    return result(start_setup(name, tokens))


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def share(setups: list[str], repeats: int, tokens: int) -> None:
    """quiet, pair and nice0 per setup and repeat (module docstring), with ratios to quiet."""
    print(f"{os.cpu_count()} CPUs; ratio = tok/s over the same repeat's quiet tok/s")
    print("repeat  setup          case    workload   tok/s        ratio   load")
    for rep in range(repeats):
        for name in setups:
            quiet = run_setup(name, tokens)
            pair = [result(p) for p in [start_setup(name, tokens), start_setup(name, tokens)]]
            loops = busy_loops(1)
            try:
                nice0 = run_setup(name, tokens)
            finally:
                for proc in loops:
                    proc.kill()
                    proc.wait()
            for workload, q in quiet.items():
                cases = {"quiet": ([q["tps"]], q["load"]),
                         "pair": ([r[workload]["tps"] for r in pair], pair[0][workload]["load"]),
                         "nice0": ([nice0[workload]["tps"]], nice0[workload]["load"])}
                for case, (tps, load) in cases.items():
                    shown = " + ".join(f"{t:.1f}" for t in tps)
                    print(f"{rep + 1:>6}  {name:<13}  {case:<6}  {workload:<9} {shown:>11}  "
                          f"{sum(tps) / q['tps']:>5.2f}  {load:>5.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contend", type=int, default=1, help="CPU-bound competitors")
    p.add_argument("--repeats", type=int, default=3, help="alternations of every setup")
    p.add_argument("--tokens", type=int, default=32, help="batch-1 output tokens")
    p.add_argument("--setups", default=None, help="comma-separated subset (default: every "
                   "setup; with --share: passive,python-llm)")
    p.add_argument("--share", action="store_true",
                   help="quiet, two engine processes, one busy loop beside (module docstring)")
    args = p.parse_args()
    args.setups = args.setups or ("passive,python-llm" if args.share else ",".join(SETUPS))
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or args.contend < 0 or args.repeats < 1 or args.tokens < 1:
        p.error(f"setups from {list(SETUPS)}, contend >= 0, repeats and tokens >= 1")
    if args.share:
        share(setups, args.repeats, args.tokens)
        return
    procs = busy_loops(args.contend)
    try:
        print(f"{args.contend} competitor(s); {os.cpu_count()} CPUs")
        print("repeat  setup          workload   tok/s   CPU s   load")
        for rep in range(args.repeats):
            for name in setups:
                for workload, r in run_setup(name, args.tokens).items():
                    print(f"{rep + 1:>6}  {name:<13}  {workload:<9} {r['tps']:>6.1f}  "
                          f"{r['cpu_s']:>6.2f}  {r['load']:>5.2f}", flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
