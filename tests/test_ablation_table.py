"""scripts/ablation_table.py: grow share pooled over samples, paired differences on shared problems."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ablation_table  # noqa: E402


def _write(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    with open(run / "samples.jsonl", "w") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps({"uid": f"gsm8k/{i}", "sample": 0, "status": "ok",
                                     "avg_kv_kept": 100.0 + i, "final_kv_len": 120, "kv_context": 200,
                                     **row}) + "\n")
        handle.write(json.dumps({"uid": "gsm8k/9", "sample": 0, "status": "failed"}) + "\n")


def test_grow_share_pools_decisions_and_pairs_fidelity_by_problem(tmp_path):
    _write(tmp_path / "growpage", [
        {"decisions": {"grow": 3, "compress": 1}, "fid_delta_nll": 0.1, "fid_agreement": 0.5},
        {"decisions": {"grow": 0, "compress": 4}, "fid_delta_nll": 0.3, "fid_agreement": 0.7},
        {"decisions": {}, "fid_delta_nll": 0.2, "fid_agreement": 0.9}])
    _write(tmp_path / "growpage-fixed", [
        {"decisions": {"compress": 2}, "fid_delta_nll": 0.2, "fid_agreement": 0.4},
        {"decisions": {"compress": 2}, "fid_delta_nll": 0.4, "fid_agreement": 0.6},
        {"decisions": {"compress": 2}, "fid_delta_nll": 0.3, "fid_agreement": 0.8}])
    frame = ablation_table.load_run(tmp_path / "growpage")
    assert len(frame) == 3  # the failed sample is left out
    # 3 grows of 8 decisions pooled (a mean of per-sample shares would give 0.375 of two samples)
    assert ablation_table.grow_share(frame) == pytest.approx(3 / 8)
    paired = ablation_table.paired_intervals(ablation_table.load_run(tmp_path / "growpage-fixed"),
                                             frame)
    # every problem's delta-NLL is 0.1 higher and its agreement 0.1 lower: no spread to resample
    assert paired["diff_fid_delta_nll"].estimate == pytest.approx(0.1)
    assert paired["diff_fid_delta_nll"].low == pytest.approx(0.1)
    assert paired["diff_fid_agreement"].high == pytest.approx(-0.1)
    text = ablation_table.table(tmp_path, "growpage")
    assert "| growpage-fixed | 3 | 0.00 [0.00, 0.00] | 2.0 [2.0, 2.0] |" in text
    with pytest.raises(ValueError, match="not a run"):
        ablation_table.table(tmp_path, "growpage-inverse")
