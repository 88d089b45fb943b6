"""FullKV: never compresses; every capacity boundary grows by one page (the uncompressed baseline).

When the pool is out of pages there is no fallback compression, so the scheduler preempts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.policies.base import KVPolicy, register_policy


@register_policy
@dataclass
class FullKV(KVPolicy):
    name = "full"
    compresses = False
    chunked_forcing = True  # it only ever allocates pages at boundaries
