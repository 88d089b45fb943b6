"""The Top-p working set of rows of attention weights (GrowPage Eq. 2/7): per row of n
non-negative weights, K = min{k : the k largest sum to at least p x the row's total}, in
[1, n]. Mass is measured relative to each row's total, so rounding in a softmax cannot push
the whole row below p. GrowPage's demand estimate counts it for every (layer, KV head,
summary) at each capacity decision (engine/policies/demand.py).

``top_p_counts(probs, p)``: probs [..., n] -> int64 [...], dispatched on the tensor: the C
kernel (cpu/top_p.c, a bisection over the float bits, no sort) for CPU float32 where the
library is built, else ``top_p_counts_torch``, the definition: the row sorted largest first
and its float64 prefix sums (on the CPU through numpy's sort of the values, which costs a
fraction of torch.sort's values and permutation). The two give the same K for every p below
1; at p = 1 the answer is where rounding puts the last prefix sums, and they may differ there.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cpu_native


def top_p_counts(probs: torch.Tensor, p: float) -> torch.Tensor:
    """K per row (module docstring): probs [..., n], n >= 1 -> int64 [...]."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and not probs.requires_grad \
            and cpu_native.available():
        return cpu_native.top_p_counts(probs, p)
    return top_p_counts_torch(probs, p)


def top_p_counts_torch(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The definition, on any device: probs [..., n] -> int64 [...]."""
    n = probs.shape[-1]
    mass = descending(probs.float()).cumsum(dim=-1)
    target = p * mass[..., -1:]
    return ((mass < target).sum(dim=-1) + 1).clamp(max=n)


def descending(x: torch.Tensor) -> torch.Tensor:
    """The values of each row of `x` (`[..., n]`) sorted largest first, as float64. On CPU through
    numpy's sort: torch.sort also builds the permutation, which costs several times the sort of
    the values alone; the sorted values are the same either way."""
    if x.device.type == "cpu" and not x.requires_grad:
        return torch.from_numpy(np.sort(x.numpy(), axis=-1)[..., ::-1].astype(np.float64))
    return x.sort(dim=-1, descending=True).values.double()
