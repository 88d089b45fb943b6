"""The `kvarena bench` app: each benchmark module registers its command on `bench_app`, and
evals/benchmarks/__init__.py imports the modules in the order `kvarena bench --help` lists them."""

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (side-by-side ratios in one run).")
