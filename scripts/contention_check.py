"""The engine's decode beside CPU-bound competitors, under each OpenMP thread setup.

    .venv/bin/python scripts/contention_check.py [--contend 1] [--repeats 3] [--tokens 32]

Starts `--contend` busy-loop processes, then runs, in alternation, one fresh process per setup:
the embedded model's batch-1 decode (`--tokens` greedy tokens, EOS ignored) and a batch of 16
(half as many tokens each), printing tok/s, process CPU seconds and the 1-minute load before each.

Setups: `spin` (torch loaded before the engine could set its OpenMP defaults: libgomp's own
300,000-iteration spin), `passive` (the engine's defaults: named for an earlier default, it now
runs engine/threads.py's bounded spin and thread governor), `passive-1t` (the same on one thread),
`passive-bound` (two threads bound one per CPU, GOMP_CPU_AFFINITY, as vLLM's CPU backend binds
its worker's threads). The findings and figures measured with it are in
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
}

CHILD = """
import json, os, sys, time
if {torch_first}:
    import torch  # before engine: the wait policy it sets comes too late for libgomp
from engine.threads import set_threads
from engine.llm import LLM
from engine.sampling import SamplingParams
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


def run_setup(name: str, tokens: int) -> dict:
    threads, extra, torch_first = SETUPS[name]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra, PYTHONPATH=str(REPO))
    code = CHILD.format(torch_first=torch_first, threads=threads, tokens=tokens)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                          capture_output=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contend", type=int, default=1, help="CPU-bound competitors")
    p.add_argument("--repeats", type=int, default=3, help="alternations of every setup")
    p.add_argument("--tokens", type=int, default=32, help="batch-1 output tokens")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset")
    args = p.parse_args()
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or args.contend < 0 or args.repeats < 1 or args.tokens < 1:
        p.error(f"setups from {list(SETUPS)}, contend >= 0, repeats and tokens >= 1")
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(args.contend)]
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
