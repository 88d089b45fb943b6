"""The GrowPage family as the mixed-workload benches run it (`bench mixed`, problems and
documents): the paper's budget B and Random's compression probability, each variant's arguments
(`growpage_args`), its row labels (`tau_label`, `start_label`) and the Table 9-shaped events table
(`events_table`)."""

from __future__ import annotations

from typing import Any

from evals.benchmarks.common import Column, Table

TAU_POLICIES = ("growpage", "growpage-inverse", "growpage-shrink")
PAPER_BUDGET_PAGES = 16  # 4096 tokens at b = 256: GrowPage-Fixed's and Zipage's budget (App. H.1)
PAPER_RANDOM_COMPRESS = 0.7  # the paper's Random, used when GrowPage made no decision


def tau_label(policy: str, tau: float, threshold: str = "fixed") -> str:
    if policy not in TAU_POLICIES:
        return policy
    return f"{policy} (tau={tau:g}{', median threshold' if threshold != 'fixed' else ''})"


def start_label(pages: int) -> str:
    """The row of a start-capacity sweep (GrowPage at an initial capacity of `pages`)."""
    return f"growpage (start={pages} pages)"


def growpage_args(policy: str, scale: Any, tau: float,
                  random_compress: float = PAPER_RANDOM_COMPRESS) -> dict:
    """GrowPage-family arguments: Fixed gets B as its budget; the others their own start (or the
    explicit start_pages), never B. scale: a bench's scale with ``protected_recent``, ``b``,
    ``start_pages``, ``block_size`` and ``threshold`` (MixedScale, DocumentScale)."""
    args: dict = {"protected_recent": scale.protected_recent}
    if policy == "growpage-fixed":
        args["budget"] = scale.b
        return args
    if scale.start_pages is not None:
        args["initial_capacity"] = scale.start_pages * scale.block_size
    if policy in TAU_POLICIES:
        args["tau"] = tau
        if scale.threshold != "fixed":
            args["threshold"] = scale.threshold
    if policy == "growpage-shrink" and tau < -0.005:
        args["shrink_threshold"] = tau
    if policy == "growpage-random":
        args["compress_prob"] = round(random_compress, 4)
    return args


def events_table(rows: list[dict], run: str, compactions: bool = False) -> Table:
    """Table 9 shape: the capacity-control events of `run` (which run the rows come from), with a
    column of every compaction when `compactions`."""
    extra = [Column("compactions", "compactions", "d")] if compactions else []
    return Table(
        "events", f"Table 9 shape: capacity-control events ({run})",
        [Column("policy", "policy"), Column("grow_decisions", "grow", "d"),
         Column("grow_ratio", "grow ratio", ".3f"), Column("compress", "Compress & Hold", "d"),
         Column("shrink", "shrink", "d"), Column("fallback", "fallback", "d"),
         Column("preemption", "preempt", "d"), Column("allocate", "allocate (no decision)", "d"),
         *extra],
        rows,
        "grow = primary grow decisions (granted + those that fell back); grow ratio = grow / "
        "(grow + Compress & Hold + shrink), the primary decisions before fallback handling "
        "(Table 9's caption); fallback = grow decisions the pool could not safely satisfy "
        "(free-page watermark), answered by Compress & Hold; allocate = pages received below a "
        "policy's start or cap, not decisions. FullKV makes no decision (ratio '-'); the fixed "
        "budgets only compress (ratio 0)." + (" compactions = every compaction run." if compactions
                                              else ""))
