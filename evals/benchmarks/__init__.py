"""Benchmarks: workloads run side by side in one process, printing ratios (never timed tests).

Commands (each module registers its own on `bench_app`): throughput (engine vs transformers),
memory (fixed-budget policies under a small KV pool), mixed (GrowPage and its variants on a mixed
workload), concurrency (Kara's concurrency-throughput effect and fidelity), soak (every
policy under random load with aborts and preemption: requests done, pages leaked), launches
(kernel launches per layer of a decode step, eager vs compiled).

OpenMP wait policy: on a shared, oversubscribed CPU, torch's OpenMP workers spin at every barrier
waiting for a peer thread the OS has descheduled; with 2 threads on 2 busy cores we measured a
576x1536 linear on 16 rows at ~24 ms with the default (spinning) policy and ~0.75 ms with
OMP_WAIT_POLICY=PASSIVE. libgomp reads the variable once, when torch loads it, so it is set here,
before any benchmark imports torch, unless the user set it. The machine facts of every result
record the policy and whether it was in place before torch loaded.

The command modules are imported in the order `kvarena bench --help` lists them.
"""
# ruff: isort: skip_file

import os
import sys

import typer

_OMP_APPLIED = "torch" not in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (side-by-side ratios in one run).")

from evals.benchmarks import common  # noqa: E402

common.OMP_POLICY_APPLIED = _OMP_APPLIED

from evals.benchmarks import throughput  # noqa: E402,F401
from evals.benchmarks import memory  # noqa: E402,F401
from evals.benchmarks import mixed  # noqa: E402,F401
from evals.benchmarks import concurrency  # noqa: E402,F401
from evals.benchmarks import kernels  # noqa: E402,F401
from evals.benchmarks import launches  # noqa: E402,F401
from evals.benchmarks import soak  # noqa: E402,F401
