"""Kara's comparison protocol: a baseline's per-sequence KV budget matched to a Kara run.

Kara (Sec. 4, "Configurations" and "Reasoning Performance") does not fix a compressed length:
"we first run Kara to obtain the realized compressed KV cache length for each sequence, and then
set the per-sequence KV budget of each baseline to match Kara under the corresponding setting".
`kvarena eval -t T -p snapkv --match-budget-to RUN_DIR` does that: RUN_DIR is a finished Kara run
(results/<model>/<task>/kara.../); for every sample (uid, sample index) the baseline runs with the
request's own budget (`SamplingParams.kv_budget`, engine/policies/fixed_budget.py) equal to the
compressed length Kara realised on that sample: `final_kv_len`, the KV slots Kara's request held
when it finished (engine/stats.py). The baseline then compresses back to that length at each page
boundary at its cap, so its cache holds between that length and one page more.

Errors before anything runs (EvalError): RUN_DIR missing or holding no run, a run of a non-Kara
policy, of another model or task, a sample the baseline needs that the Kara run lacks (not run,
failed, or recorded before runs recorded `final_kv_len`), a baseline policy without a fixed
budget, or configured to compress the prompt only (PyramidKV and Ada-KV as published: their cache
would grow past the matched length during decode; `decode_compress=true` holds them to it,
engine/policies/per_head.py), and a matched budget that does not exceed the baseline's protected
tokens. A sample whose
prompt tokenises to another length than in the Kara run (another prompt template or thinking
setting) is refused when its prompt is rendered, before it is submitted.

The matched run is its own experiment: its label (and directory) is the policy's plus
`+matched=<Kara run label>`, and config.json records the Kara run it read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from engine.config import is_int_in
from evals import results as R
from evals.results.files import load_samples, read_json
from evals.results.labels import model_slug, slug
from evals.run.settings import EvalError

FIELD = "final_kv_len"  # the per-sample record field holding Kara's realised compressed length


class MatchedBudgetError(EvalError):
    """A matched-budget source that cannot serve the run."""


@dataclass(frozen=True)
class MatchedBudgets:
    """Per-sample budgets read from one Kara run.

    source: the run directory; config: its config.json; budgets / prompt_tokens: per (uid, sample)
    of the samples that finished there.
    """

    source: Path
    config: dict
    budgets: dict
    prompt_tokens: dict

    @property
    def label(self) -> str:
        return str(self.config.get("label"))

    def run_label(self, label: str) -> str:
        """The matched run's label: the baseline's plus the Kara run it matches."""
        return slug(f"{label}+matched={self.label}")

    def describe(self) -> dict:
        """What config.json records about the source."""
        return {"run": str(self.source), "label": self.label, "policy": self.config.get("policy"),
                "policy_args": self.config.get("policy_args"), "samples": len(self.budgets)}

    def check_run(self, model: str, task: str, policy: str) -> None:
        """The source is a run of this model and task, and `policy` takes a fixed budget."""
        from engine.policies.base import policy_registry
        from engine.policies.fixed_budget import FixedBudgetPolicy

        if model_slug(model) != self.config.get("model"):
            raise MatchedBudgetError(
                f"--match-budget-to {self.source}: a run of model {self.config.get('model')!r}, "
                f"not {model_slug(model)!r}")
        if task != self.config.get("task"):
            raise MatchedBudgetError(
                f"--match-budget-to {self.source}: a run of task {self.config.get('task')!r}, "
                f"not {task!r}")
        registry = policy_registry()
        cls = registry.get(policy)
        if cls is None or not issubclass(cls, FixedBudgetPolicy):
            fixed = sorted(n for n, c in registry.items() if issubclass(c, FixedBudgetPolicy))
            raise MatchedBudgetError(
                f"--match-budget-to needs a fixed-budget policy (one of {fixed}), got {policy!r}")

    def check_samples(self, keys: Iterable[tuple[str, int]], policy: str, policy_args: dict) -> None:
        """`policy` built with `policy_args` holds its budget through decode, every sample to
        run has a matched budget, and each exceeds the policy's protected tokens."""
        from engine.policies.base import build_policy

        built = build_policy(policy, policy_args)
        if not built.holds_budget:
            raise MatchedBudgetError(
                f"--match-budget-to: {policy} as configured compresses the prompt only, so its "
                f"cache grows past the matched length during decode; pass --policy-arg "
                f"decode_compress=true to hold it there")
        protected = built.num_protected
        keys = list(keys)
        missing = [k for k in keys if k not in self.budgets]
        if missing:
            shown = ", ".join(f"{u} sample {j}" for u, j in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise MatchedBudgetError(
                f"--match-budget-to {self.source}: no finished sample with {FIELD} for "
                f"{shown}{more} ({len(missing)} of the {len(keys)} samples to run); run Kara on "
                f"them first (same --limit/--samples)")
        small = [(k, self.budgets[k]) for k in keys if self.budgets[k] <= protected]
        if small:
            (u, j), b = small[0]
            raise MatchedBudgetError(
                f"--match-budget-to {self.source}: Kara's compressed length for {u} sample {j} is "
                f"{b} tokens, not above {policy}'s {protected} protected tokens "
                f"({len(small)} such samples); lower the policy's window")

    def budget_for(self, uid: str, sample: int, prompt_tokens: int) -> int:
        """The budget of one sample; its prompt must have the length Kara saw."""
        key = (uid, sample)
        if key not in self.budgets:
            raise MatchedBudgetError(f"--match-budget-to {self.source}: no budget for {uid} "
                                     f"sample {sample}")
        if self.prompt_tokens.get(key) != prompt_tokens:
            raise MatchedBudgetError(
                f"--match-budget-to {self.source}: {uid} sample {sample} has a "
                f"{prompt_tokens}-token prompt here but {self.prompt_tokens.get(key)} in the Kara "
                f"run (another prompt template or thinking setting?)")
        return self.budgets[key]


def load(run_dir: str | Path) -> MatchedBudgets:
    """Read a Kara run's per-sample realised compressed lengths (module docstring)."""
    from engine.policies.base import policy_registry
    from engine.policies.kara import Kara

    registry = policy_registry()
    path = Path(run_dir)
    config_path = path / R.CONFIG_FILE
    if not config_path.is_file():
        raise MatchedBudgetError(
            f"--match-budget-to {path}: no finished run there (no {R.CONFIG_FILE}); give the "
            f"directory of a Kara run, results/<model>/<task>/<label>")
    try:
        config = read_json(config_path)
    except (OSError, ValueError) as e:
        raise MatchedBudgetError(f"--match-budget-to {path}: unreadable {R.CONFIG_FILE} ({e})") from None
    policy = config.get("policy")
    cls = registry.get(policy)
    if cls is None or not issubclass(cls, Kara):
        raise MatchedBudgetError(
            f"--match-budget-to {path}: a run of policy {policy!r}, not Kara's; the protocol "
            f"matches baselines to Kara's realised compressed lengths")
    budgets, prompts = {}, {}
    for key, rec in load_samples(path / R.SAMPLES_FILE, repair=False).records.items():
        value = _record_budget(rec)
        if value is not None:
            budgets[key], prompts[key] = value, rec.get("prompt_tokens")
    if not budgets:
        raise MatchedBudgetError(
            f"--match-budget-to {path}: no finished sample records {FIELD} (a run recorded "
            f"before per-sample compressed lengths were; rerun it)")
    return MatchedBudgets(path, config, budgets, prompts)


def _record_budget(rec: dict[str, Any]) -> int | None:
    value = rec.get(FIELD)
    if rec.get("status") != "ok" or not is_int_in(value, 1):
        return None
    return value
