"""The GrowPage family as the mixed-workload benches run it (`bench mixed`, problems and
documents): the paper's budget B and Random's compression probability, each variant's arguments
(`growpage_args`) and its row label (`tau_label`)."""

from __future__ import annotations

from typing import Any

TAU_POLICIES = ("growpage", "growpage-inverse", "growpage-shrink")
PAPER_BUDGET_PAGES = 16  # 4096 tokens at b = 256: GrowPage-Fixed's and Zipage's budget (App. H.1)
PAPER_RANDOM_COMPRESS = 0.7  # the paper's Random, used when GrowPage made no decision


def tau_label(policy: str, tau: float, threshold: str = "fixed") -> str:
    if policy not in TAU_POLICIES:
        return policy
    return f"{policy} (tau={tau:g}{', median threshold' if threshold != 'fixed' else ''})"


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
