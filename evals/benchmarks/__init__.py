"""Benchmarks: workloads run side by side in one process, printing ratios (never timed tests).

Commands (each module registers its own on `bench_app`, app.py): throughput (engine vs transformers),
memory (fixed-budget policies under a small KV pool), mixed (GrowPage and its variants on a mixed
workload), concurrency (Kara's concurrency-throughput effect and fidelity), soak (every
policy under random load with aborts and preemption: requests done, pages leaked), peer (FullKV
against vLLM's CPU backend run from another venv), launches (kernel launches per layer of a decode
step, eager vs compiled), step (the decode step of random 8B-shaped models against transformers and
the bandwidth floor, with the GPU checks), projections (a decode step's projections kernel by
kernel on CPU: a chain of its weights against the plain-sum floor, and GFLOP/s per shape), forced
(teacher forcing in forced runs against one decode step per forced token), policy-cost (every
policy's per-token time against FullKV's on teacher-forced documents, split into decode, signals,
decisions and compaction), parity (kept positions and greedy continuations of each policy against
NVIDIA kvpress's press of the same method, run from another venv).

OpenMP: importing `engine` sets a bounded spin (GOMP_SPINCOUNT) before torch loads unless the user
set the wait policy, and the engine's thread governor follows the free cores (engine/threads.py
says why); the machine facts of every result record both and the governor's state.

The command modules are imported in the order `kvarena bench --help` lists them.
"""
# ruff: isort: skip_file

import engine  # noqa: F401  (first: sets OpenMP's spin before anything loads torch)

from evals.benchmarks.app import bench_app  # noqa: E402,F401  (cli.py adds it as `kvarena bench`)

from evals.benchmarks import throughput  # noqa: E402,F401
from evals.benchmarks import memory  # noqa: E402,F401
from evals.benchmarks import mixed  # noqa: E402,F401
from evals.benchmarks import concurrency  # noqa: E402,F401
from evals.benchmarks import kernels  # noqa: E402,F401
from evals.benchmarks import launches  # noqa: E402,F401
from evals.benchmarks import soak  # noqa: E402,F401
from evals.benchmarks import step  # noqa: E402,F401
from evals.benchmarks import peer  # noqa: E402,F401
from evals.benchmarks import parity  # noqa: E402,F401
from evals.benchmarks import projections  # noqa: E402,F401
from evals.benchmarks import forced  # noqa: E402,F401
from evals.benchmarks import policy_cost  # noqa: E402,F401
