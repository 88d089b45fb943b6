"""R-KV's key redundancy: how much each cached key repeats the others (R-KV Sec. 3), scored by
R-KV, G-KV and Zipage's redundancy term at compression time.

``key_redundancy(keys, threshold, temperature, block, spare_first) -> [layers, kv_heads, length]``
is the definition, over dense keys `[layers, kv_heads, length, head_dim]` (all pairs, or
Zipage's per-page form). The paged forms score one sequence's cached keys through its block
table, as a policy view asks for them (engine/kernels/backend.py picks one per engine):

``paged_key_redundancy_{torch,c}(k_cache, block_table, length, threshold, temperature,
spare_first, block)``

    k_cache:     [layers, kv_heads, num_blocks, block_size, head_dim]
    block_table: [nb] int, the sequence's pages in order; keys 0..length-1 are scored
    returns      [layers, kv_heads, length] float32

`_torch` gathers the pages and applies the definition (any device); `_c` is the C kernel
(CPU float32, cpu/key_redundancy.c), which reads the keys in place and forms the similarity
matrix a strip of rows at a time instead of O(length^2) floats per layer (per run: a small
matrix per run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_native
from engine.kernels.attention_scores import dense_keys

# Similarities held at once by the redundancy score (floats; layers are taken together up to it):
# 2 MB, so the several elementwise passes over a chunk (threshold, last similar key, sums) find
# it in the CPU's cache instead of streaming a larger one from memory each time.
_SIM_ELEMS = 1 << 19


def key_redundancy(keys: torch.Tensor, *, threshold: float = 0.5, temperature: float = 1.0,
                   block: int | None = None, spare_first: bool = False) -> torch.Tensor:
    """R-KV's redundancy score of every key (R-KV Sec. 3, `rkv/utils.py cal_similarity`).

    Per (layer, KV head): cosine similarity S[i, j] between the L2-normalised keys, diagonal
    zeroed. For each key i, its most recent similar key (the largest j with S[i, j] > threshold)
    is spared: S[i, j] := 0, so the newest copy of a repeated token is not penalised. The
    redundancy of key j is softmax_j(mean_i S[i, j] / temperature). R-KV uses temperature 1;
    Zipage's redundancy term uses 0.4. Departure: R-KV's code also zeroes S[i, 0] when key i has
    no similar key (an artefact of its max over masked indices); here only a similar key is spared.
    spare_first: reproduce that artefact of R-KV's code (S[i, 0] := 0 for a key i with no similar
    key), which lowers slot 0's mean similarity and with it its redundancy, so the first token
    (an attention sink) is kept more often.
    block: compare each key only with keys of its own page and divide by the page size instead of
    the length (Zipage's "lightning" variant, `lightning_redudancy_score.py`); None: all pairs.

    keys: `[layers, kv_heads, length, head_dim]`. Returns float32 `[layers, kv_heads, length]`.
    All pairs: the similarity matrices `[layers', kv_heads, length, length]` of as many layers as
    `_SIM_ELEMS` allows at a time (O(length^2), as R-KV's definition needs). Per page:
    `_page_redundancy`, O(length x block) memory and time, as Zipage's per-page kernel.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if block is not None:
        if block < 1:
            raise ValueError(f"block must be >= 1 slots, got {block}")
        return _page_redundancy(keys, threshold, temperature, block, spare_first)
    layers, heads, length, _ = keys.shape
    rows = torch.arange(length, device=keys.device, dtype=torch.int32)
    step = max(1, _SIM_ELEMS // max(1, heads * length * length))
    out = []
    for lo in range(0, layers, step):
        k = _unit(keys[lo:lo + step])
        sim = k @ k.transpose(-1, -2)                               # [l, H, T, T]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        has = _spare_last_similar(sim, sim > threshold, rows)
        if spare_first:
            sim[..., 0].masked_fill_(~has, 0.0)
        out.append(torch.softmax(sim.sum(dim=-2) / length / temperature, dim=-1))
    return torch.cat(out) if out else keys.new_zeros(keys.shape[:3], dtype=torch.float32)


def _unit(keys: torch.Tensor) -> torch.Tensor:
    """L2-normalised keys in float32 (`[..., head_dim]`), as R-KV normalises them."""
    k = keys.float()
    return k / (k.norm(dim=-1, keepdim=True) + 1e-8)


def _spare_last_similar(sim: torch.Tensor, similar: torch.Tensor, rows: torch.Tensor,
                        spares: torch.Tensor | None = None) -> torch.Tensor:
    """Zero, in place, S[i, j] for the last similar key j of every row i (`similar[..., i, j]`,
    over the last axis; `spares` (broadcast to `[..., i]`) False: leave row i alone) and return
    which rows have a similar key, `[..., i]` bool. rows: int32 `[n]`, the rows' own columns: a
    row with nothing to spare points at its diagonal, already 0, so one scatter serves all.
    sim: float `[..., n, m]`; similar: bool, the same shape."""
    last = torch.where(similar, torch.arange(similar.shape[-1], device=sim.device,
                                             dtype=torch.int32), -1).amax(dim=-1)
    has = last >= 0
    spare = has if spares is None else has & spares
    sim.scatter_(-1, torch.where(spare, last, rows).long().unsqueeze(-1), 0.0)
    return has


def _page_redundancy(keys: torch.Tensor, threshold: float, temperature: float, block: int,
                     spare_first: bool) -> torch.Tensor:
    """`key_redundancy(..., block=block)` computed page by page.

    The keys are cut into pages `[layers, kv_heads, pages, block, head_dim]` (the last page padded
    with zero keys, which are masked out of the similar-key search and add nothing to a sum), and
    S is formed inside each page only: every pair across pages is 0 in the all-pairs form, so the
    column sums are the same. One case needs care: with threshold < 0 a zero (a pair across pages)
    counts as similar, so a key of any page but the last has its most recent similar key in a
    later page, where S is already 0: nothing in its page is spared, and it never lacks a similar
    key (spare_first). keys: `[layers, kv_heads, length, head_dim]` -> float32 `[layers, kv_heads,
    length]`.
    """
    layers, heads, length, dim = keys.shape
    device = keys.device
    pages = -(-length // block)
    real = (torch.arange(pages * block, device=device) < length).view(pages, block)
    across = threshold < 0 and pages > 1          # a pair across pages counts as similar
    spares = torch.ones(pages, 1, dtype=torch.bool, device=device)  # rows that spare in-page
    if across:
        spares[:-1] = False
    lanes = torch.arange(block, device=device, dtype=torch.int32)
    step = max(1, _SIM_ELEMS // max(1, heads * pages * block * block))
    out = []
    for lo in range(0, layers, step):
        k = F.pad(_unit(keys[lo:lo + step]), (0, 0, 0, pages * block - length))
        k = k.view(-1, heads, pages, block, dim)
        sim = k @ k.transpose(-1, -2)                               # [l, H, P, b, b]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        # padded keys are never similar
        has = _spare_last_similar(sim, (sim > threshold) & real[:, None, :], lanes, spares)
        if spare_first and not across:
            # S[i, 0] is non-zero only for the keys of the first page
            sim[:, :, 0, :, 0].masked_fill_(~has[:, :, 0], 0.0)
        mean = sim.sum(dim=-2).flatten(2)[..., :length] / block     # [l, H, T]
        out.append(torch.softmax(mean / temperature, dim=-1))
    return torch.cat(out) if out else keys.new_zeros(keys.shape[:3], dtype=torch.float32)


def paged_key_redundancy_torch(k_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                               threshold: float = 0.5, temperature: float = 1.0,
                               spare_first: bool = False,
                               block: int | None = None) -> torch.Tensor:
    """Module docstring: the used pages gathered (attention_scores.dense_keys), then
    `key_redundancy` (all pairs, or per run of `block` slots)."""
    return key_redundancy(dense_keys(k_cache, block_table, length), threshold=threshold,
                          temperature=temperature, block=block, spare_first=spare_first)


def paged_key_redundancy_c(k_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                           threshold: float = 0.5, temperature: float = 1.0,
                           spare_first: bool = False, block: int | None = None) -> torch.Tensor:
    """Module docstring: the C kernel (cpu_native.key_redundancy), keys read where they lie."""
    return cpu_native.key_redundancy(k_cache, block_table, length, threshold, temperature,
                                     spare_first, block)
