"""Where the engine keeps what it builds once and reuses: ``$KVARENA_CACHE`` (default
``~/.cache/kvarena``), holding converted GGUF checkpoints (``gguf/``, engine/models/loader.py), the
CPU kernels' libraries (``native/``, engine/kernels/cpu_native.py) and inductor's compile artifacts
(``inductor/``, engine/decode_graph.py). Read at each call, so a changed variable takes effect."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVARENA_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/kvarena")


def cache_root() -> Path:
    """``$KVARENA_CACHE`` or ``~/.cache/kvarena``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_ROOT).expanduser()
