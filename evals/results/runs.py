"""The finished runs below a directory, read back for the leaderboard, the report and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from evals.results import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE
from evals.results.files import load_samples, read_json
from evals.results.labels import model_slug


@dataclass
class RunResult:
    """One result directory read back: its config, metrics and (lazily) sample records."""

    path: Path
    config: dict
    metrics: dict

    @property
    def label(self) -> str:
        return str(self.config.get("label") or self.path.name)

    @property
    def task(self) -> str:
        return str(self.config.get("task") or self.path.parent.name)

    @property
    def model(self) -> str:
        return model_slug(str(self.config.get("model") or self.path.parent.parent.name))

    def samples(self) -> list[dict]:
        return list(load_samples(self.path / SAMPLES_FILE, repair=False).records.values())


def with_nominal_budget(metrics: dict, config: Mapping[str, Any]) -> dict:
    """``metrics`` with ``kv_budget_nominal`` (and its interval): the average KV budget where the
    run's policy has a nominal one (``KVPolicy.has_budget``: a fixed budget, GrowPage's
    capacity, PyramidKV/Ada-KV with ``decode_compress``), None where it has none (FullKV,
    prompt-only and retention policies, whose ``avg_kv_budget`` is their allocated slots). Derived
    when read, so older trees get it too."""
    from engine.policies.base import build_policy, policy_registry

    cls = policy_registry().get(str(config.get("policy")))
    nominal = cls is not None and cls.has_budget
    if cls is not None and not nominal and hasattr(cls, "holds_budget"):
        try:  # a prompt-only policy run with decode_compress holds a budget too
            nominal = build_policy(str(config["policy"]), config.get("policy_args") or {}).holds_budget
        except Exception:  # arguments of another code version: no nominal budget claimed
            nominal = False
    return {**metrics, "kv_budget_nominal": metrics.get("avg_kv_budget") if nominal else None,
            "kv_budget_nominal_ci": metrics.get("avg_kv_budget_ci") if nominal else None}


def find_runs(dirs: Sequence[str | Path], skipped: list[str] | None = None) -> list[RunResult]:
    """Every result directory (one holding config.json and metrics.json) at or below ``dirs``,
    in path order. A directory that does not exist is an error naming it. A run whose config.json
    or metrics.json cannot be read or is not a JSON object is left out (re-running it rewrites
    them), and described in ``skipped`` when given."""
    found: dict[Path, RunResult] = {}
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise FileNotFoundError(f"results directory {str(root)!r} does not exist")
        candidates = ([root / METRICS_FILE] if (root / METRICS_FILE).exists()
                      else sorted(root.rglob(METRICS_FILE)))
        for metrics_path in candidates:
            run = metrics_path.parent
            if not (run / CONFIG_FILE).exists() or run.resolve() in found:
                continue
            why, values = None, []
            for path in (run / CONFIG_FILE, metrics_path):
                try:
                    values.append(read_json(path))
                except (OSError, ValueError, RecursionError) as e:
                    why = f"{path.name} cannot be read ({type(e).__name__}: {e})"
                    break
                if not isinstance(values[-1], dict):
                    why = f"{path.name} holds a JSON {type(values[-1]).__name__}, not an object"
                    break
            if why:
                if skipped is not None:
                    skipped.append(f"{run}: {why}")
                continue
            config, metrics = values
            found[run.resolve()] = RunResult(run, config, with_nominal_budget(metrics, config))
    return sorted(found.values(), key=lambda r: str(r.path))
