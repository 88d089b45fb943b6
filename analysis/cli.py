"""`kvarena analyze ...`: the papers' studies (commands are registered by the analysis modules)."""

import typer

analyze_app = typer.Typer(no_args_is_help=True, help="Reproduce the papers' analysis studies.")
