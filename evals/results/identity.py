"""What a run is: the settings a resumed run must match (``IDENTITY``), and the engine settings its
samples came from, which may differ between invocations (``engine_settings_summary``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from evals.jsonio import json_default
from evals.results import ResultsMismatchError

# Settings that change what a sample produces; a resumed run must match them exactly.
IDENTITY = ("model", "task", "task_options", "data_source", "policy", "policy_args", "preset",
            "max_tokens", "temperature", "seed", "thinking", "block_size")
# Segment fields that are engine settings (not identity: they may change between invocations).
ENGINE_SETTING_KEYS = ("kv_cache_tokens", "max_num_seqs", "num_pages", "max_model_len", "device")
MIXED = "mixed"


def check_identity(existing: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> None:
    """Raise ResultsMismatchError naming every identity setting that differs."""
    diffs = []
    for key in IDENTITY:
        a, b = _canon(existing.get(key)), _canon(wanted.get(key))
        if a != b:
            diffs.append(f"{key}: stored {existing.get(key)!r}, asked {wanted.get(key)!r}")
    if diffs:
        raise ResultsMismatchError(
            f"{where} holds results of a run with other settings ({'; '.join(diffs)}). "
            f"Resuming would mix two experiments: pass another --out, or delete the directory "
            f"to start over."
        )


def _canon(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=json_default))


def engine_settings_summary(records: Sequence[Mapping[str, Any]],
                            segments: Sequence[Mapping[str, Any]]) -> dict:
    """The engine settings the held ``records`` came from, by their segments.

    Returns ``{"mixed": bool, "settings": [{**setting, "segments": [...], "samples": n}]}``;
    a segment that recorded no settings (older runs) counts as its own ``{"unknown": True}``.
    """
    by_segment = {s.get("segment"): s.get("settings") for s in segments}
    groups: dict[str, dict] = {}
    for r in records:
        seg = r.get("segment")
        setting = by_segment.get(seg) or {"unknown": True}
        key = json.dumps(setting, sort_keys=True, default=json_default)
        group = groups.setdefault(key, {**setting, "segments": [], "samples": 0})
        group["samples"] += 1
        if seg not in group["segments"]:
            group["segments"].append(seg)
    settings = sorted(groups.values(), key=lambda g: min(g["segments"], key=lambda x: (x is None, x)))
    for g in settings:
        g["segments"].sort(key=lambda x: (x is None, x))
    return {"mixed": len(settings) > 1, "settings": settings}
