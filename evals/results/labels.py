"""Run labels and directory names: ``<out>/<model>/<task>/<label>/`` (the package docstring says
what a label holds)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping


def slug(text: str) -> str:
    """A file-name-safe version of ``text`` (letters, digits, ``._+=-`` kept)."""
    out = re.sub(r"[^A-Za-z0-9._+=-]+", "_", str(text)).strip("_")
    return out or "_"


def model_slug(model: str) -> str:
    """The model's directory name: the embedded default's name, or a path's last component
    without a ``.gguf`` suffix."""
    from engine.config import DEFAULT_MODEL
    from engine.models.loader import EMBEDDED_MODEL_NAMES

    if str(model).lower() in {n.lower() for n in EMBEDDED_MODEL_NAMES}:
        return DEFAULT_MODEL
    name = Path(str(model).rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return slug(name)


def format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


# Generation settings that join a run's label where they differ from the task preset's, each by
# its short name, in this order (after the policy arguments): snapkv+budget=96+mt=512+T=0+bs=16.
SETTING_LABELS = (("max_tokens", "mt"), ("temperature", "T"), ("block_size", "bs"))


def run_label(policy: str, args: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> str:
    """``policy`` plus ``+key=value`` for each given argument, sorted, then ``+mt=``, ``+T=`` and
    ``+bs=`` for the generation settings in ``settings`` (``setting_label_args``); see the module
    docstring."""
    parts = [policy] + [f"{k}={format_value(v)}" for k, v in sorted(args.items())]
    parts += [f"{short}={format_value(settings[name])}" for name, short in SETTING_LABELS
              if name in (settings or {})]
    return slug("+".join(parts))


def setting_label_args(used: Mapping[str, Any], preset: Mapping[str, Any]) -> dict:
    """``{setting: value}`` of the generation settings (``SETTING_LABELS``) a run uses where they
    differ from its task preset's: what its label names beside the policy arguments."""
    return {name: used[name] for name, _ in SETTING_LABELS
            if name in used and used[name] != preset.get(name)}


def budget_label_args(field: str | None, policy_args: Mapping[str, Any], user_args: Mapping[str, Any],
                      default: Any) -> dict:
    """``{field: budget}`` when a run's label must name its fixed KV budget, else ``{}``.

    field: the policy's budget field (None: it takes no fixed budget); policy_args: the arguments
    the run uses; user_args: those the user gave (a budget among them is in the label already);
    default: the budget the run would use without ``--kv-budget`` (the task preset's, in whole
    pages; None where the policy falls back on its own default)."""
    if field is None or field in user_args or field not in policy_args:
        return {}
    value = policy_args[field]
    return {} if value == default else {field: value}


def run_dir(out: str | Path, model: str, task: str, label: str) -> Path:
    return Path(out) / model_slug(model) / slug(task) / label
