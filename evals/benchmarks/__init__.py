"""Benchmarks: workloads run side by side in one process, printing ratios (never timed tests)."""

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (side-by-side ratios in one run).")
