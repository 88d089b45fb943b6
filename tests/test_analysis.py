"""Analysis studies: rank statistics, D_p, the FullKV probes, the counterfactual replay, outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.common import (
    RunSettings,
    average_ranks,
    load_prompts,
    partial_spearman,
    pool_tokens,
    quantile_bins,
    sign_agreement,
    spearman,
)
from analysis.demand_study import (
    DEFAULT_VARIANTS,
    DemandRecorder,
    demand_study,
    held_out_queries,
    run_demand,
)
from analysis.replay import (
    ForcedGrowPage,
    ForcePlan,
    ReplayConfig,
    pick_evenly,
    replay_study,
    run_replay,
    window_nll,
)
from analysis.sparsity import SparsityTap, coverage_demand, run_sparsity, sparsity_study
from engine.llm import LLM
from engine.policies.base import Action
from engine.policies.growpage import GrowPage
from engine.sampling import SamplingParams
from tiny_models import make_tiny_llama_dir

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
# Tiny-scale GrowPage for the replay: control starts at 2 pages, 2 protected slots, and p = 0.5 so
# that delta is not stuck at 0 on tiny candidate sets.
TINY_GROWPAGE = {"initial_capacity": 2 * BLOCK, "protected_recent": 2, "top_p": 0.5}
# 9 tokens = 2 pages + 1: with a prefix-cache hit its last token would be prefilled alone, as a
# one-token step that updates GrowPage's summaries; the replay must not depend on that.
REPLAY_PROMPTS = [list(range(5, 14)), [12, 13, 14]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("analysis-llama"))  # 4 q / 2 kv heads


# -- rank statistics --------------------------------------------------------------------------


def test_average_ranks_share_the_mean_rank_of_ties():
    assert average_ranks([3.0, 1.0, 3.0, 3.0]).tolist() == [3.0, 1.0, 3.0, 3.0]
    assert average_ranks([10.0, -1.0, 5.0, 5.0]).tolist() == [4.0, 1.0, 2.5, 2.5]


def test_spearman_matches_a_hand_computed_case_with_ties():
    # ranks x: [1, 2.5, 2.5, 4, 5]; ranks y: [2, 1, 3.5, 3.5, 5]; both have mean 3.
    # deviations dx = [-2, -.5, -.5, 1, 2], dy = [-1, -2, .5, .5, 2]
    # sum dx*dy = 2 + 1 - .25 + .5 + 4 = 7.25; sum dx^2 = sum dy^2 = 9.5  ->  rho = 29 / 38
    x = [1.0, 2.0, 2.0, 3.0, 5.0]
    y = [2.0, 1.0, 4.0, 4.0, 6.0]
    assert spearman(x, y) == pytest.approx(29 / 38, abs=1e-12)
    assert spearman(y, x) == pytest.approx(29 / 38, abs=1e-12)


def test_spearman_agrees_with_pandas_rank_correlation_and_drops_nan_pairs():
    gen = np.random.default_rng(0)
    x = gen.integers(0, 6, size=40).astype(float)  # many ties
    y = x * 0.5 + gen.integers(0, 4, size=40)
    expected = pd.DataFrame({"x": x, "y": y}).corr(method="spearman").loc["x", "y"]
    assert spearman(x, y) == pytest.approx(expected, abs=1e-12)
    assert spearman(list(x) + [math.nan], list(y) + [3.0]) == pytest.approx(expected, abs=1e-12)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # constant side
    assert math.isnan(spearman([1.0], [2.0]))


def test_partial_spearman_removes_what_two_series_share_through_position():
    gen = np.random.default_rng(0)
    position = np.arange(400, dtype=float)
    x = position + 40 * gen.standard_normal(400)  # both follow position, independent otherwise
    y = position + 40 * gen.standard_normal(400)
    assert spearman(x, y) > 0.8
    assert abs(partial_spearman(x, y, position)) < 0.15
    # a relation beyond position survives, and equals the residual correlation computed directly
    y2 = position + 40 * gen.standard_normal(400) + 60 * (x - position)
    rx, ry, rz = average_ranks(x), average_ranks(y2), average_ranks(position)
    res = [r - np.polyval(np.polyfit(rz, r, 1), rz) for r in (rx, ry)]
    assert partial_spearman(x, y2, position) == pytest.approx(np.corrcoef(*res)[0, 1])
    assert partial_spearman(x, y2, position) > 0.5
    assert math.isnan(partial_spearman([1.0, 2.0], [1.0, 2.0], [0.0, 1.0]))  # < 3 triples
    assert partial_spearman(x, x, np.zeros(400)) == pytest.approx(1.0)  # constant z: plain rho


def test_sign_agreement_ignores_zero_pairs():
    assert sign_agreement([1.0, -1.0, 0.0, 2.0], [3.0, 1.0, 5.0, 0.0]) == pytest.approx(0.5)
    assert math.isnan(sign_agreement([0.0], [1.0]))


def test_quantile_bins_split_by_x_and_average_y():
    bins = quantile_bins([4.0, 1.0, 3.0, 2.0], [40.0, 10.0, 30.0, 20.0], bins=2)
    assert [(b["x_min"], b["x_max"], b["n"], b["mean"]) for b in bins] == [
        (1.0, 2.0, 2, 15.0), (3.0, 4.0, 2, 35.0)]


def test_pick_evenly_keeps_ends():
    assert pick_evenly(list(range(10)), 3) == [0, 4, 9]  # linspace 0, 4.5, 9 rounded half-even
    assert pick_evenly([1, 2], 5) == [1, 2]


def test_bad_prompt_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(empty)
    with pytest.raises(ValueError, match="--num-prompts"):
        load_prompts(None, 0)
    good = tmp_path / "p.txt"
    good.write_text("a\n\nb\nc\n")
    assert load_prompts(good, 2) == ["a", "b"]
    with pytest.raises(ValueError, match="--window"):
        ReplayConfig(window=0)


# -- cluster bootstrap -------------------------------------------------------------------------


def test_cluster_bootstrap_resamples_whole_requests():
    from evals.intervals import bootstrap_mean, cluster_bootstrap

    gen = np.random.default_rng(0)
    means = gen.normal(size=10)
    # 10 requests of 20 identical rows: the rows of a request carry one draw of information
    frame = pd.DataFrame({"request": np.repeat(np.arange(10), 20), "v": np.repeat(means, 20)})
    clustered = cluster_bootstrap(frame, "request", {"mean": lambda f: f["v"].mean()})["mean"]
    per_request = bootstrap_mean(means)
    assert (clustered.low, clustered.high) == pytest.approx((per_request.low, per_request.high))
    assert clustered.clusters == 10 and clustered.estimate == pytest.approx(means.mean())
    # treating the 200 rows as independent draws (the old p-values' mistake) is far narrower
    rows = bootstrap_mean(frame["v"].to_numpy())
    assert rows.high - rows.low < 0.5 * (clustered.high - clustered.low)
    again = cluster_bootstrap(frame, "request", {"mean": lambda f: f["v"].mean()})["mean"]
    assert again == clustered  # seeded


def test_cluster_bootstrap_interval_shrinks_with_more_requests():
    from evals.intervals import cluster_bootstrap

    gen = np.random.default_rng(1)

    def width(requests: int) -> float:
        x = gen.normal(size=requests * 8)
        frame = pd.DataFrame({"request": np.repeat(np.arange(requests), 8), "x": x,
                              "y": x + gen.normal(size=x.size)})
        rho = cluster_bootstrap(frame, "request", {"rho": lambda f: spearman(f["x"], f["y"])})
        return rho["rho"].high - rho["rho"].low

    assert width(64) < 0.7 * width(8)


def test_cluster_bootstrap_reports_undefined_intervals():
    from evals.intervals import cluster_bootstrap, fmt_interval

    one = pd.DataFrame({"request": [0, 0, 0], "x": [1.0, 2.0, 3.0], "y": [1.0, 3.0, 2.0]})
    rho = cluster_bootstrap(one, "request", {"rho": lambda f: spearman(f["x"], f["y"])})["rho"]
    assert rho.estimate == pytest.approx(0.5) and rho.low is None and not rho.excludes(0.0)
    assert fmt_interval(rho.to_dict()) == "0.500 [n/a]"
    flat = pd.DataFrame({"request": [0, 1, 2], "x": [1.0, 1.0, 1.0], "y": [1.0, 2.0, 3.0]})
    rho = cluster_bootstrap(flat, "request", {"rho": lambda f: spearman(f["x"], f["y"])})["rho"]
    assert rho.estimate is None and fmt_interval(rho.to_dict()) == "n/a"
    with pytest.raises(ValueError, match="cluster column 'req'"):
        cluster_bootstrap(one, "req", {})


# -- D_p -------------------------------------------------------------------------------------


def naive_coverage(weights: list[float], p: float) -> int:
    total = sum(weights)
    acc = 0.0
    for k, w in enumerate(sorted(weights, reverse=True), start=1):
        acc += w
        if acc >= p * total - 1e-12:
            return k
    return len(weights)


def test_coverage_demand_matches_a_naive_count():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 5, 17, generator=gen) * 3, dim=-1)
    for p in (0.5, 0.9, 0.99):
        got = coverage_demand(probs, p)
        for idx in np.ndindex(3, 5):
            assert int(got[idx]) == naive_coverage(probs[idx].tolist(), p)
    assert coverage_demand(torch.tensor([[1.0, 0.0, 0.0]]), 0.99).tolist() == [1]
    with pytest.raises(ValueError, match="coverage p"):
        coverage_demand(probs, 0.0)


def test_sparsity_probe_records_dp_of_the_models_real_attention(tiny_dir):
    from transformers import AutoModelForCausalLM

    p = 0.9
    frame, outs = run_sparsity(str(tiny_dir), PROMPTS[:1], 12, BLOCK, show_progress=False,
                               llm=LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=256,
                                       policy=SparsityTap(top_p=p)))
    prompt = PROMPTS[0]
    tokens = prompt + outs[0].token_ids
    # One row per observed query: the last prompt row, then every decode step but the last.
    # (the final step's query, at position len - 2, is never observed: the request ends there)
    assert frame["position"].tolist() == list(range(len(prompt) - 1, len(tokens) - 2))
    assert frame["step"].tolist() == [pos + 1 - len(prompt) for pos in frame["position"]]
    assert (frame["num_keys"] == frame["position"] + 1).all()

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        attn = hf(torch.tensor([tokens]), output_attentions=True).attentions  # L x [1, Hq, T, T]
    for _, row in frame.iterrows():
        t = int(row["position"])
        for layer, a in enumerate(attn):
            naive = [naive_coverage(a[0, h, t, : t + 1].tolist(), p) for h in range(a.shape[1])]
            assert row[f"dp_layer{layer}"] == pytest.approx(float(np.mean(naive)))
        assert row["dp_ratio_mean"] == pytest.approx(row["dp_mean"] / row["num_keys"])


def test_sparsity_study_writes_csv_png_and_summary(tiny_dir, tmp_path):
    settings = RunSettings(str(tiny_dir), BLOCK, 10, 2, 0.0, 0, False)
    summary = sparsity_study(str(tiny_dir), PROMPTS, settings, tmp_path, show_progress=False)
    frame = pd.read_csv(tmp_path / "sparsity.csv")
    assert list(frame.columns[:6]) == ["request", "step", "position", "num_keys", "dp_mean",
                                       "dp_ratio_mean"]
    assert [c for c in frame.columns if c.startswith("dp_layer")] == ["dp_layer0", "dp_layer1"]
    assert set(frame["request"]) == {0, 1}
    assert (tmp_path / "sparsity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(summary["per_request"]) == {0, 1}
    across = summary["across_requests"]["dp_ratio_mean"]
    assert across["estimate"] == pytest.approx(
        frame.groupby("request")["dp_ratio_mean"].mean().mean())
    assert across["clusters"] == 2 and summary["spearman_step_ratio"]["clusters"] == 2
    assert len(summary["layer_mean_ratio_interval"]) == 2
    assert json.loads((tmp_path / "config.json").read_text())["block_size"] == BLOCK


# -- demand study ----------------------------------------------------------------------------


def expected_boundaries(prompt_len: int, output_tokens: int, block: int) -> list[int]:
    """Positions m processed by decode steps (prompt_len .. prompt_len + out - 2) that find the
    FullKV pages full (m a multiple of the block)."""
    return [m for m in range(prompt_len, prompt_len + output_tokens - 1) if m % block == 0]


# The tiny study: horizon and exclusion of one page, GrowPage's control from 3 pages; the main
# signal's short summary is the newest query (beta_S = 0), whose weight a one-page window can
# hold out (the paper's 0.9 needs a window of 46 tokens, `held_out_queries`).
TINY_DEMAND = dict(horizon_tokens=BLOCK, exclude_tokens=BLOCK, initial_capacity=3 * BLOCK,
                   variants={**DEFAULT_VARIANTS, "delta": {"preset": "paper", "beta_short": 0.0}})


def test_demand_study_records_one_row_per_boundary(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512,
              policy=DemandRecorder(**TINY_DEMAND))
    frame, outs = run_demand(str(tiny_dir), PROMPTS, 30, BLOCK, show_progress=False, llm=llm)
    for r, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        rows = frame[frame["request"] == r]
        grows = [e for e in out.events if e["action"] == "grow"]
        assert len(rows) == len(grows) > 3
        assert rows["position"].tolist() == [e["logical_len"] for e in grows]
        assert rows["position"].tolist() == expected_boundaries(len(prompt), out.num_output_tokens,
                                                                BLOCK)
        assert rows["boundary"].tolist() == list(range(len(rows)))
        assert (rows["candidates"] == rows["position"] - BLOCK).all()
        # decisions from GrowPage's start on; below it no target is computed
        assert (rows["decision"] == (rows["pages"] >= 3)).all()
        assert rows.loc[~rows["decision"], "r_current"].isna().all()
        assert not rows.loc[~rows["decision"], "complete"].any()
        # the last boundary's next window never completed; earlier complete rows have both
        assert rows["future_queries"].iloc[-1] < BLOCK and not rows["complete"].iloc[-1]
        done = rows[rows["complete"]]
        assert len(done) > 0
        assert np.allclose(done["future_change"], done["r_future"] - done["r_current"])
        assert np.allclose(done["future_change_last"], done["r_future"] - done["r_current_last"])
        assert ((done["r_current"] > 0) & (done["r_current"] <= 1)).all()
    # FullKV throughout: nothing was compressed
    assert all(e["action"] == "grow" for out in outs for e in out.events)


def test_demand_windows_span_the_horizon_on_the_candidates_left_by_the_exclusion():
    """Horizon and exclusion in tokens (not pages): the current window is the `horizon` queries
    before the boundary, the future one the `horizon` from it on, both over C_t = all slots but the
    last `exclude`, recomputed here directly from the queries and keys."""
    from analysis.demand_control import SyntheticView
    from analysis.demand_study import window_ratios
    from engine.policies.base import EngineSpec

    block, horizon, exclude, total = 4, 10, 6, 60
    recorder = DemandRecorder(horizon_tokens=horizon, exclude_tokens=exclude, initial_capacity=8,
                              variants={"delta": {"beta_short": 0.5, "beta_long": 0.9}})
    recorder.prepare(block)
    recorder.bind(EngineSpec(block, 2, 2, 1, 4, 1000, 4096))
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 1, total, 4, generator=gen)
    queries = torch.randn(total, 2, 2, 4, generator=gen)
    state = recorder.new_state()
    view = SyntheticView(state, keys, 3, block, recorder.signals().ema_betas)
    view.length = 2
    for position in range(2, total - 1):
        if position >= 3 and position % block == 0:
            recorder.on_boundary(view)
        view.step(queries[position])
        recorder.observe(view, state, queries[position], position)
    frame = pd.DataFrame(state.rows)
    done = frame[(frame["future_queries"] == horizon) & (frame["current_queries"] == horizon)]
    assert len(done) >= 5
    checked_sym = 0
    for _, row in done.iterrows():
        m, c = int(row["position"]), int(row["candidates"])
        assert c == m - exclude
        current = window_ratios(queries[m - horizon:m], keys[:, :, :c], recorder.top_p)
        future = window_ratios(queries[m:m + horizon], keys[:, :, :c], recorder.top_p)
        assert row["r_current"] == pytest.approx(current[0])
        assert row["r_current_last"] == pytest.approx(current[2])
        assert row["r_future"] == pytest.approx(future[0])
        assert row["r_future_q"] == pytest.approx(future[1])
        # the held-out target: the current window less its newest query (betas (0.5, 0.9),
        # h = 10: d(0) = 0.999 - 0.651 > 0 >= d(1) = 0.499 - 0.551, |d(1)| nearer 0)
        assert recorder.held_gap == 1
        held = window_ratios(queries[m - horizon:m - 1], keys[:, :, :c], recorder.top_p)
        assert row["r_current_held"] == pytest.approx(held[0])
        assert row["future_change_held"] == pytest.approx(future[0] - held[0])
        # the symmetric target: the current window over C_{t-h}, its own start's candidate set
        if c <= horizon:  # C_{t-h} is empty
            assert math.isnan(row["r_current_sym"])
            continue
        own = window_ratios(queries[m - horizon:m], keys[:, :, :c - horizon], recorder.top_p)
        assert row["r_current_sym"] == pytest.approx(own[0])
        assert row["future_change_sym"] == pytest.approx(future[0] - own[0])
        checked_sym += 1
    assert checked_sym >= 3


def test_demand_signal_is_growpages_own_delta(tiny_dir):
    """GrowPage with tau = -1 always grows (a FullKV cache) and logs delta at every boundary past
    its initial capacity: the probe's delta must be the same number at the same positions."""
    prompt = PROMPTS[0]
    probe = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512, policy=DemandRecorder(
        horizon_tokens=BLOCK, exclude_tokens=BLOCK, initial_capacity=2 * BLOCK,
        variants={"delta": {}}))
    frame, _ = run_demand(str(tiny_dir), [prompt], 30, BLOCK, show_progress=False, llm=probe)
    growpage = GrowPage(tau=-1.0, initial_capacity=2 * BLOCK, protected_recent=2)
    out = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512, policy=growpage).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    logged = {e["logical_len"]: e["info"] for e in out.events if "delta" in e["info"]}
    assert len(logged) > 3
    by_position = frame.set_index("position")
    for position, info in logged.items():
        assert by_position.loc[position, "delta"] == pytest.approx(info["delta"], abs=1e-12)
        assert by_position.loc[position, "r_S"] == pytest.approx(info["r_S"], abs=1e-12)


def test_demand_probe_main_signal_has_the_papers_betas_and_table2_rows():
    probe = DemandRecorder()
    probe.prepare(16)
    assert probe.horizon_tokens == probe.exclude_tokens == 256  # the paper's page of tokens
    betas = {name: est.betas for name, est in probe.estimators.items()}
    assert betas["delta"] == (0.9, 0.999)
    assert betas["delta_bS0"] == (0.0, 0.999) and betas["delta_bL099"] == (0.9, 0.99)
    assert betas["delta_bS099"] == (0.99, 0.999) and betas["delta_bS0_bL099"] == (0.0, 0.99)
    policy = GrowPage(preset="ratio")
    policy.prepare(16)
    assert betas["delta_ratio"] == policy.betas
    ema = probe.signals().ema_betas
    for name, (short, long) in probe.pairs.items():
        assert (ema[short], ema[long]) == probe.estimators[name].betas
    assert len(ema) == len(set(ema))
    with pytest.raises(ValueError, match="horizon_tokens"):
        DemandRecorder(horizon_tokens=0)


def test_demand_study_writes_csv_png_and_summary(tiny_dir, tmp_path):
    from analysis.demand_study import DemandConfig

    settings = RunSettings(str(tiny_dir), BLOCK, 30, 2, 0.6, 0, False)
    summary = demand_study(str(tiny_dir), PROMPTS, settings, tmp_path,
                           DemandConfig(**TINY_DEMAND, resamples=200), show_progress=False)
    frame = pd.read_csv(tmp_path / "demand.csv")
    for col in ("request", "boundary", "position", "candidates", "delta", "r_S", "r_L",
                "delta_bS0", "delta_auto", "delta_ratio", "delta_entropy", "r_current", "r_future",
                "future_change", "complete"):
        assert col in frame.columns
    assert (tmp_path / "demand.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["complete"] == int(frame["complete"].sum())
    assert set(summary["pooled"]) >= {"delta", "delta_bS0", "r_S", "r_current"}
    rho = summary["pooled"]["delta"]["spearman"]
    assert rho["clusters"] == summary["requests"] == frame.loc[frame["complete"], "request"].nunique()
    assert [n for n, t in summary["targets"].items() if t["shares_term_with_delta"]] == \
        ["future_change", "future_change_last"]
    offset = summary["offset"]
    signal = frame[frame["delta"].notna()]
    assert offset["delta_positive_all_boundaries"]["estimate"] == pytest.approx(
        (signal["delta"] > 0).mean())
    assert offset["delta_positive_decision_boundaries"]["estimate"] == pytest.approx(
        (signal.loc[signal["decision"], "delta"] > 0).mean())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["temperature"] == 0.6 and config["horizon_tokens"] == BLOCK
    assert config["variant_params"]["delta"]["beta_long"] == 0.999
    assert config["held_out_queries"] == held_out_queries((0.0, 0.999), BLOCK) == 1



CONTROL_CONFIG = dict(horizon_tokens=16, exclude_tokens=8, initial_capacity=32, resamples=200,
                      variants={"delta": {"beta_short": 0.5, "beta_long": 0.95},
                                "delta_bS0": {"beta_short": 0.0, "beta_long": 0.95}})


@pytest.mark.parametrize("amplitude", [0.4, 0.0])
def test_positive_control_recovers_the_known_future_demand(amplitude):
    """The demand pipeline on a synthetic process whose demand oscillates slowly finds a high rho
    (and a sign agreement well above chance); with a constant latent (amplitude 0, nothing to
    predict) it finds none, so the control can fail."""
    from analysis.demand_control import SyntheticProcess, run_control
    from analysis.demand_study import DemandConfig, summarize_demand

    frame, settings = run_control(SyntheticProcess(requests=6, amplitude=amplitude),
                                  DemandConfig(**CONTROL_CONFIG))
    assert settings["period"] == int(8 * (20 + 16))  # 8 x (tau_L + horizon)
    summary = summarize_demand(frame, resamples=200)
    main = summary["pooled"]["delta"]
    rows = frame[frame["complete"]]
    assert summary["requests"] == 6 and len(rows) > 60
    assert rows["pages"].min() >= 2  # GrowPage's start: 32 tokens = 2 pages of 16
    if amplitude:
        assert main["spearman"]["estimate"] > 0.6 and main["spearman"]["low"] > 0.4
        assert main["sign_agreement"]["estimate"] > main["chance_sign_agreement"]["estimate"] + 0.15
        assert spearman(rows["future_change_held"], rows["latent_change"]) > 0.8
    else:
        assert abs(main["spearman"]["estimate"]) < 0.3


def test_held_out_target_has_no_null_offset_where_the_papers_target_has_one():
    """With nothing to predict (amplitude 0) the paper's change shares the short summary's query
    noise with delta and correlates negatively with it; the held-out target, whose window leaves
    out the newest queries that balance the two summaries' weights, centres on 0 (pooled over 48
    requests at two seeds)."""
    from analysis.demand_control import SyntheticProcess, run_control
    from analysis.demand_study import DemandConfig

    assert held_out_queries((0.5, 0.95), 16) == 1
    assert held_out_queries((0.9, 0.999), 256) == 15  # the paper's betas and page
    assert held_out_queries((0.0, 0.999), 256) == 1
    # no balance: a short summary no faster than the long one, a window too short for it
    assert held_out_queries((0.999, 0.9), 16) is None
    assert held_out_queries((0.9, 0.999), 45) is None and held_out_queries((0.9, 0.999), 46) == 43
    for seed in (0, 1):
        frame, _ = run_control(SyntheticProcess(requests=48, amplitude=0.0, seed=seed),
                               DemandConfig(**CONTROL_CONFIG))
        rows = frame[frame["complete"]]
        assert len(rows) > 1000 and frame.attrs["held_out_queries"] == 1
        assert spearman(rows["delta"], rows["future_change"]) < -0.08
        assert abs(spearman(rows["delta"], rows["future_change_held"])) < 0.05


def test_synthetic_nuisances_add_sink_and_recency_logits():
    """Key j's logit for the query at t is sharpness cos(theta_t) z_j + sin(theta_t), plus the
    sink logit for the first slots and recency * j (a decay of e every 1 / recency tokens behind
    the query, as softmax ignores the constant -recency * t); without nuisances only the first."""
    from analysis.demand_control import CONTROLS, SyntheticProcess, synthetic_request

    process = SyntheticProcess(**CONTROLS["nuisance"])
    keys, queries, latent = synthetic_request(process, 300, 200.0, np.random.default_rng(0))
    d = process.head_dim
    logits = torch.einsum("lhtd,lksd->lhts", queries, keys) / math.sqrt(d)
    base = torch.einsum("lhtd,lksd->lhts", queries[..., :2], keys[..., :2]) / math.sqrt(d)
    extra = (logits - base)[0, 0, 5]  # one query; the same extra for every query
    expected = process.recency * torch.arange(300.0)
    expected[:process.sinks] += process.sink_logit
    assert torch.allclose(extra, expected, atol=1e-4)
    assert latent[-1] < latent[0]  # negative drift: attention concentrates over the request
    plain = SyntheticProcess()
    keys, queries, _ = synthetic_request(plain, 300, 200.0, np.random.default_rng(0))
    assert not keys[..., 2:].any() and not queries[..., 2:].any()
    with pytest.raises(ValueError, match="head_dim"):
        SyntheticProcess(recency=0.01, head_dim=2)


def test_controls_run_at_a_given_length_and_block():
    """--control-tokens sets each request's length and the block its own (the model study's)."""
    from analysis.demand_control import CONTROLS, SyntheticProcess, run_control
    from analysis.demand_study import DemandConfig, summarize_demand

    config = DemandConfig(**{**CONTROL_CONFIG, "initial_capacity": 64})
    for name in ("negative", "nuisance"):
        frame, settings = run_control(SyntheticProcess(requests=4, tokens=400, block_size=16,
                                                       **CONTROLS[name]), config)
        assert settings["tokens_per_request"] == 400 and settings["block_size"] == 16
        assert (frame["position"] % 16 == 0).all() and frame["position"].max() < 400
        rows = frame[frame["complete"]]
        assert len(rows) > 40 and rows["position"].min() >= 64
        summary = summarize_demand(frame, resamples=100)
        assert "partial_spearman" in summary["pooled"]["delta"]
    # exponential recency is memoryless: renormalised over C_t, the nearer and the farther window
    # see the same profile, so with nothing to predict the paper's change has no offset; the
    # symmetric one compares ratios over candidate sets of different sizes, and has one
    frame, _ = run_control(SyntheticProcess(requests=4, tokens=400, block_size=16, amplitude=0.0,
                                            recency=1 / 16), config)
    rows = frame[frame["complete"]]
    assert abs(rows["future_change"].mean()) < 0.002 and rows["future_change_sym"].mean() < -0.01


def test_control_study_writes_the_studys_outputs(tmp_path):
    from analysis.demand_control import SyntheticProcess, control_study
    from analysis.demand_study import DemandConfig

    summary = control_study(SyntheticProcess(requests=3, periods=0.5), DemandConfig(
        **CONTROL_CONFIG), tmp_path)
    for name in ("demand.csv", "demand.png", "summary.json", "config.json"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["control"]["spearman_target_vs_latent"] == summary["control"][
        "spearman_target_vs_latent"]
    assert json.loads((tmp_path / "config.json").read_text())["control"] == "synthetic"


def test_demand_summary_bootstraps_over_requests():
    from analysis.demand_study import summarize_demand

    gen = np.random.default_rng(2)
    n = 6 * 10
    delta = gen.normal(size=n)
    frame = pd.DataFrame({
        "request": np.repeat(np.arange(6), 10), "position": np.tile(np.arange(10) * 16, 6),
        "delta": delta, "delta_bS0": gen.normal(size=n), "r_S": gen.random(n),
        "r_current": gen.random(n), "future_change_held": delta + 0.5 * gen.normal(size=n),
        "complete": True, "decision": True})
    frame["future_change"] = frame["future_change_q"] = frame["future_change_held"]
    frame["future_change_last"] = -frame["future_change_held"]
    frame.loc[frame.index[-1], "complete"] = False  # left out of every statistic
    done = frame[frame["complete"]]
    summary = summarize_demand(frame, resamples=300)
    main = summary["pooled"]["delta"]
    assert summary["requests"] == 6 and summary["complete"] == n - 1
    assert main["spearman"]["estimate"] == pytest.approx(spearman(done["delta"],
                                                                  done["future_change_held"]))
    assert main["spearman"]["clusters"] == 6 and main["spearman"]["low"] > 0.3
    assert main["spearman_future_change_last"]["estimate"] == pytest.approx(
        -main["spearman"]["estimate"])
    assert main["sign_agreement"]["estimate"] == pytest.approx(
        sign_agreement(done["delta"], done["future_change_held"]))
    assert "sign_agreement" not in summary["pooled"]["r_S"]
    from analysis.demand_study import chance_sign_agreement

    p_d, p_c = (done["delta"] > 0).mean(), (done["future_change_held"] > 0).mean()
    assert main["chance_sign_agreement"]["estimate"] == pytest.approx(
        p_d * p_c + (1 - p_d) * (1 - p_c))
    assert chance_sign_agreement(pd.Series([1.0, 2.0]), pd.Series([-1.0, -2.0])) == 0.0
    assert main["centred_sign_agreement"]["estimate"] == pytest.approx(
        sign_agreement(done["delta"] - done["delta"].median(), done["future_change_held"]))
    assert summary["spearman_position"]["delta"]["estimate"] == pytest.approx(
        spearman(done["delta"], done["position"]))
    assert main["partial_spearman"]["estimate"] == pytest.approx(
        partial_spearman(done["delta"], done["future_change_held"], done["position"]))
    assert "spearman_future_change_sym" not in main  # a column this frame lacks is left out


# -- counterfactual replay -------------------------------------------------------------------


@pytest.mark.parametrize("tau, force", [(1.0, Action.GROW), (-1.0, Action.COMPRESS)])
def test_forced_decision_overrides_growpage_and_shows_in_the_events(tiny_dir, tau, force):
    # tau = 1 never grows by itself, tau = -1 always does: the forced action is the opposite.
    policy = ForcedGrowPage(tau=tau, **TINY_GROWPAGE)
    llm = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512, policy=policy)
    natural = Action.COMPRESS if force is Action.GROW else Action.GROW
    policy.queue_plans([ForcePlan((natural,), force), None])
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    forced_out, free_out = llm.generate([PROMPTS[0], PROMPTS[0]], params)
    assert not policy.plans
    demand = {e["info"]["demand_index"]: e for e in forced_out.events if "demand_index" in e["info"]}
    assert demand[0]["action"] == natural.value and demand[0]["info"]["control"] == "replayed"
    assert demand[1]["action"] == force.value and demand[1]["info"]["control"] == "forced"
    assert demand[1]["info"]["natural"] == natural.value
    assert "delta" in demand[1]["info"]
    if force is Action.GROW:
        assert demand[1]["pages_after"] == demand[1]["pages_before"] + 1
    else:
        assert demand[1]["pages_after"] == demand[1]["pages_before"]
        assert demand[1]["physical_after"] == (demand[1]["pages_before"] - 1) * BLOCK
    free = [e for e in free_out.events if "demand_index" in e["info"]]
    assert free and all(e["action"] == natural.value and e["info"]["control"] == "natural"
                        for e in free)


def test_replay_nll_full_is_fullkv_teacher_forcing_and_branches_are_clean(tiny_dir):
    config = ReplayConfig(growpage=dict(TINY_GROWPAGE), max_num_seqs=8, window=BLOCK)
    result = run_replay(str(tiny_dir), REPLAY_PROMPTS, 30, BLOCK, config=config,
                        show_progress=False)
    rows = result.rows
    assert len(rows) >= 6 and rows["clean"].all()
    # the cost of earlier compressions: none before any compression, NLL_grow - NLL_full always
    assert np.allclose(rows["cumulative_cost"], rows["nll_grow"] - rows["nll_full"])
    untouched = rows[rows["earlier_compressions"] == 0]
    assert len(untouched) and np.allclose(untouched["cumulative_cost"], 0.0, atol=1e-4)
    for r, ref in enumerate(result.references):
        n = len(ref.token_ids)
        excess = (window_nll(result.natural[r].token_logprobs, 0, n)
                  - window_nll(ref.token_logprobs, 0, n))
        assert np.allclose(rows.loc[rows["request"] == r, "natural_excess"], excess)
    # every usable demand boundary was branched at (no --max-boundaries)
    assert len(rows) == sum(b.output_index + BLOCK <= len(result.references[b.request].token_ids)
                            for b in result.boundaries)
    full = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512)
    for r, ref in enumerate(result.references):
        forced = full.generate([REPLAY_PROMPTS[r]], SamplingParams(
            temperature=0.0, forced_tokens=tuple(ref.token_ids), max_tokens=len(ref.token_ids),
            logprobs=True))[0]
        assert forced.token_ids == ref.token_ids
        for _, row in rows[rows["request"] == r].iterrows():
            o = int(row["output_index"])
            assert row["nll_full"] == pytest.approx(window_nll(forced.token_logprobs, o, BLOCK),
                                                    abs=1e-5)
    assert np.allclose(rows["benefit"], rows["nll_compress"] - rows["nll_grow"])
    # the branch taking GrowPage's own action reproduces the natural run's window
    own = np.where(rows["natural_action"] == "grow", rows["nll_grow"], rows["nll_compress"])
    assert np.allclose(own, rows["nll_natural"], atol=1e-5)
    assert np.allclose(rows["delta_branch"], rows["delta"], atol=1e-9)
    assert (rows["delta"] != 0).any()  # the check above is not vacuous
    # growing at the first demand boundary, before any compression, is exactly FullKV
    first = rows[rows["boundary"] == 0]
    assert np.allclose(first["nll_grow"], first["nll_full"], atol=1e-4)
    assert (rows["output_index"] == rows["position"] + 1
            - rows["request"].map({i: len(p) for i, p in enumerate(REPLAY_PROMPTS)})).all()


def test_replay_on_documents_takes_the_text_as_the_reference(tiny_dir, tmp_path):
    """forced texts: the reference is FullKV teacher-forced on them (its tokens are the text),
    and the branches score windows of that text; --documents drives it from the CLI."""
    from pathlib import Path

    from typer.testing import CliRunner

    from analysis.cli import analyze_app

    texts = [list(range(40, 70)), list(range(20, 44))]
    config = ReplayConfig(growpage=dict(TINY_GROWPAGE), max_num_seqs=8, window=BLOCK)
    result = run_replay(str(tiny_dir), REPLAY_PROMPTS, 5, BLOCK, config=config,
                        show_progress=False, forced=texts)
    assert [list(r.token_ids) for r in result.references] == texts
    rows = result.rows
    assert len(rows) >= 4 and rows["clean"].all()
    for r, ref in enumerate(result.references):
        for _, row in rows[rows["request"] == r].iterrows():
            o = int(row["output_index"])
            assert row["nll_full"] == pytest.approx(window_nll(ref.token_logprobs, o, BLOCK))
    with pytest.raises(ValueError, match="one non-empty continuation per prompt"):
        run_replay(str(tiny_dir), REPLAY_PROMPTS, 5, BLOCK, config=config, show_progress=False,
                   forced=texts[:1])

    out = tmp_path / "docs"
    with pytest.warns(UserWarning, match="empty file"):  # the fixture's empty essay is reported
        result = CliRunner().invoke(analyze_app, [
            "replay", "--model", str(tiny_dir), "--documents", "2", "--doc-tokens", "96",
            "--data", str(Path(__file__).parent / "fixtures" / "data" / "niah"), "--block-size",
            str(BLOCK), "--max-boundaries", "2", "-a", "initial_capacity=8", "-a",
            "protected_recent=2", "--out", str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["documents"] == 2 and config["doc_tokens"] == 96
    assert len(pd.read_csv(out / "replay.csv")) == 4  # 2 boundaries of each document


def test_replay_study_writes_csv_png_and_summary(tiny_dir, tmp_path):
    settings = RunSettings(str(tiny_dir), BLOCK, 24, 2, 0.0, 0, False)
    config = ReplayConfig(growpage=dict(TINY_GROWPAGE), max_boundaries=2, max_num_seqs=8,
                          window=BLOCK)
    summary = replay_study(str(tiny_dir), PROMPTS, settings, tmp_path, config, show_progress=False)
    frame = pd.read_csv(tmp_path / "replay.csv")
    assert list(frame.columns) == ["request", "boundary", "position", "output_index", "pages",
                                   "delta", "r_S", "r_L", "natural_action", "nll_full",
                                   "nll_grow", "nll_compress", "benefit", "nll_natural",
                                   "cumulative_cost", "earlier_compressions", "natural_excess",
                                   "delta_branch", "window", "clean"]
    assert frame.groupby("request").size().max() <= 2
    assert (tmp_path / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "boundaries.csv").exists()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["rows"] == len(frame) == summary["rows"]
    clean = frame[frame["clean"]]
    assert saved["benefit"]["estimate"] == pytest.approx(clean["benefit"].mean())
    assert saved["benefit"]["clusters"] == clean["request"].nunique() == saved["requests"]
    gt, le = saved["benefit_delta_gt_0"], saved["benefit_delta_le_0"]
    if gt["n"] and le["n"]:
        assert saved["benefit_gap_gt_minus_le"]["estimate"] == pytest.approx(
            gt["estimate"] - le["estimate"])


def test_pool_tokens_leaves_room_for_every_request():
    tokens = pool_tokens(3, 30, 4)
    assert tokens % 4 == 0
    assert tokens // 4 >= 3 * (math.ceil(31 / 4) + 1) + 8


# -- command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("command, extra, files", [
    ("sparsity", ["--max-tokens", "10"], ["sparsity.csv", "sparsity.png", "summary.json"]),
    ("demand", ["--max-tokens", "30", "--horizon-tokens", "4", "--exclude-tokens", "4",
                "--resamples", "200"], ["demand.csv", "demand.png", "summary.json"]),
    ("replay", ["--max-tokens", "24", "--max-boundaries", "2", "-a", "initial_capacity=8",
                "-a", "protected_recent=2"], ["replay.csv", "replay.png", "summary.json"]),
])
def test_analyze_commands_write_their_outputs(tiny_dir, tmp_path, command, extra, files):
    from typer.testing import CliRunner

    from analysis.cli import analyze_app

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("add two numbers\nexplain paged attention\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(analyze_app, [
        command, "--model", str(tiny_dir), "--prompts-file", str(prompts), "--block-size",
        str(BLOCK), "--out", str(out), "--threads", "1", *extra])
    assert result.exit_code == 0, result.output
    for name in files:
        assert (out / name).stat().st_size > 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_prompts"] == 2 and config["block_size"] == BLOCK
    if command == "demand":  # --resamples reaches every interval
        summary = json.loads((out / "summary.json").read_text())
        assert config["resamples"] == 200
        assert summary["pooled"]["delta"]["spearman"]["resamples"] == 200
        # a 4-token window cannot hold out the paper's short summary: the paper's target, named
        assert summary["main_target"] == "future_change"
        assert "Spearman(delta, future_change) =" in " ".join(result.output.split())


def test_demand_on_documents_forces_the_text_and_records_its_boundaries(tiny_dir, tmp_path):
    """--documents: the longdoc task's documents, a 64-token prompt and the rest teacher-forced,
    so the probe sees the queries of that text, one decode step per token."""
    from pathlib import Path

    from typer.testing import CliRunner

    from analysis.cli import analyze_app
    from analysis.demand_study import DemandConfig

    forced = [list(range(20, 60)), list(range(30, 58))]
    llm = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=512,
              policy=DemandRecorder(**TINY_DEMAND))
    frame, outs = run_demand(str(tiny_dir), PROMPTS, 5, BLOCK, show_progress=False, llm=llm,
                             config=DemandConfig(**TINY_DEMAND), forced=forced)
    assert [list(o.token_ids) for o in outs] == forced  # max_tokens (5) is not what stops them
    for r, prompt in enumerate(PROMPTS):
        assert frame.loc[frame["request"] == r, "position"].tolist() == expected_boundaries(
            len(prompt), len(forced[r]), BLOCK)
    with pytest.raises(ValueError, match="one non-empty continuation per prompt"):
        run_demand(str(tiny_dir), PROMPTS, 5, BLOCK, show_progress=False, llm=llm,
                   forced=forced[:1])

    essays = Path(__file__).parent / "fixtures" / "data" / "niah"
    out = tmp_path / "docs"
    with pytest.warns(UserWarning, match="empty file"):  # the fixture's empty essay is reported
        result = CliRunner().invoke(analyze_app, [
            "demand", "--model", str(tiny_dir), "--documents", "2", "--doc-tokens", "112",
            "--data", str(essays), "--block-size", str(BLOCK), "--horizon-tokens", "8",
            "--exclude-tokens", "8", "--initial-capacity", "24", "--resamples", "100", "--out",
            str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["documents"] == 2 and config["doc_tokens"] == 112 and config["prefix_tokens"] == 64
    rows = pd.read_csv(out / "demand.csv")
    assert rows["request"].nunique() == 2 and rows["position"].max() < 112
    assert rows["complete"].any()
    # decisions from 24 tokens, below GrowPage's own start (9 pages = 36): both are summarised
    late = json.loads((out / "summary.json").read_text())["at_growpage_start"]
    assert late["from_position"] == 9 * BLOCK
    assert late["complete"] == int((rows["complete"] & (rows["position"] >= 36)).sum()) > 0
    bad = CliRunner().invoke(analyze_app, ["demand", "--model", str(tiny_dir), "--documents", "2",
                                           "--num-prompts", "3", "--threads", "1"])
    assert bad.exit_code == 2 and "replaces --prompts-file" in " ".join(bad.output.split())


def test_replay_defaults_sample_score_four_pages_and_name_the_directory_by_them(
        tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from analysis.cli import _model_tag, analyze_app

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("add two numbers\nexplain paged attention\n")
    monkeypatch.chdir(tmp_path)  # the default output directory is relative to the working one
    result = CliRunner().invoke(analyze_app, [
        "replay", "--model", str(tiny_dir), "--prompts-file", str(prompts), "--block-size",
        str(BLOCK), "--threads", "1", "--max-tokens", "40", "--max-boundaries", "2",
        "-a", "initial_capacity=8", "-a", "protected_recent=2"])
    assert result.exit_code == 0, result.output
    out = (tmp_path / "results" / "analysis"
           / f"replay-{_model_tag(str(tiny_dir))}-b{BLOCK}-t40-n2-w{4 * BLOCK}-k2-temp0.6")
    config = json.loads((out / "config.json").read_text())
    assert config["window"] == 4 * BLOCK and config["temperature"] == 0.6
    frame = pd.read_csv(out / "replay.csv")
    assert (frame["window"] == 4 * BLOCK).all()


def test_analyze_rejects_bad_input_with_a_clear_message(tiny_dir, tmp_path):
    from typer.testing import CliRunner

    from analysis.cli import analyze_app

    runner = CliRunner()
    missing = runner.invoke(analyze_app, ["sparsity", "--model", str(tiny_dir), "--prompts-file",
                                          str(tmp_path / "nope.txt"), "--threads", "1"])
    # rich wraps long lines: compare with whitespace collapsed
    assert missing.exit_code == 2 and "does not exist" in " ".join(missing.output.split())
    bad_knob = runner.invoke(analyze_app, ["replay", "--model", str(tiny_dir), "-a", "bogus=1",
                                           "--threads", "1"])
    assert bad_knob.exit_code == 2 and "unknown argument" in " ".join(bad_knob.output.split())


# -- capacity alignment (App. I) -------------------------------------------------------------


def _write_run(root, label: str, task: str, records: list[dict], seed: int = 0, policy="zipage"):
    from evals import results as R
    from evals.jsonio import write_json
    from evals.results.files import SampleWriter

    path = root / "smollm2-135m-instruct" / task / label
    write_json(path / R.CONFIG_FILE, {"label": label, "model": "smollm2-135m-instruct",
                                        "task": task, "policy": policy, "seed": seed})
    with SampleWriter(path / R.SAMPLES_FILE) as writer:
        for rec in records:
            writer.write({"task": task, "status": "ok", **rec})
    write_json(path / R.METRICS_FILE, {"complete": True})
    return path


def _sweep_tree(root, correct: dict[str, dict[int, list[bool]]], budgets=(64, 128, 256),
                task="amc23"):
    """A real sweep output (evals.run.sweep.analyze_sweep) over synthetic budget runs.
    correct: uid -> budget -> per-sample correctness."""
    from evals.run.settings import EvalOutcome, EvalSettings
    from evals.run.sweep import analyze_sweep

    outcomes = []
    for b in budgets:
        records = [{"uid": uid, "sample": j, "correct": ok}
                   for uid, per in correct.items() for j, ok in enumerate(per[b])]
        path = _write_run(root, f"zipage+budget={b}", task, records)
        outcomes.append(EvalOutcome(path, path.name, task, {"complete": True}))
    base = EvalSettings(task=task, policy="zipage", out=str(root), samples=3)
    return analyze_sweep(base, list(budgets), "majority", outcomes).path


def _growpage_tree(root, capacity: dict[str, list[float]], task="amc23", seed=0,
                   field="avg_kv_allocated", budget=None):
    """A GrowPage run; `budget` (a constant) adds an avg_kv_budget field to every sample."""
    extra = {} if budget is None else {"avg_kv_budget": budget}
    records = [{"uid": uid, "sample": j, field: c, "correct": False, **extra}
               for uid, caps in capacity.items() for j, c in enumerate(caps)]
    return _write_run(root / "eval", "growpage", task, records, seed=seed, policy="growpage")


# B* by construction (majority of 3 samples, Eq. 1): p0, p1 -> 64; p2, p3 -> 128;
# p4, p5 -> 256; p6 solved at 64 only (not at larger budgets) -> Unsolved; p7 never -> Unsolved.
YES, NO = [True, True, False], [False, False, True]
SWEEP_CORRECT = {
    "amc23/0": {64: YES, 128: YES, 256: YES}, "amc23/1": {64: YES, 128: YES, 256: YES},
    "amc23/2": {64: NO, 128: YES, 256: YES}, "amc23/3": {64: NO, 128: YES, 256: YES},
    "amc23/4": {64: NO, 128: NO, 256: YES}, "amc23/5": {64: NO, 128: NO, 256: YES},
    "amc23/6": {64: YES, 128: NO, 256: NO}, "amc23/7": {64: NO, 128: NO, 256: NO},
}


def test_capacity_study_joins_sweep_classes_with_growpage_capacity(tmp_path):
    from analysis.capacity import UNSOLVED, capacity_study
    from evals.run.sweep import UNSOLVED as SWEEP_UNSOLVED

    assert UNSOLVED == SWEEP_UNSOLVED
    sweep = _sweep_tree(tmp_path, SWEEP_CORRECT)
    caps = {"amc23/0": [100, 110], "amc23/1": [90, 100], "amc23/2": [150, 170],
            "amc23/3": [160, 160], "amc23/4": [300, 260], "amc23/5": [250, 250],
            "amc23/6": [400, 400], "amc23/7": [380, 420], "amc23/9": [10, 10]}
    evaluation = _growpage_tree(tmp_path, caps, budget=144.0)
    out = tmp_path / "capacity"
    summary = capacity_study(sweep, evaluation, out)
    frame = pd.read_csv(out / "capacity.csv", dtype={"b_star": str})
    assert dict(zip(frame["uid"], frame["b_star"])) == {
        "amc23/0": "64", "amc23/1": "64", "amc23/2": "128", "amc23/3": "128",
        "amc23/4": "256", "amc23/5": "256", "amc23/6": UNSOLVED, "amc23/7": UNSOLVED}
    assert frame.set_index("uid").loc["amc23/4", "capacity"] == pytest.approx(280.0)
    assert summary["only_in_eval"] == 1 and summary["only_in_sweep"] == 0
    assert summary["capacity_field"] == "avg_kv_allocated"
    # the other capacity field is correlated too: a constant one has no rank correlation
    assert summary["spearman_other_fields"]["avg_kv_budget"]["estimate"] is None
    assert "avg_kv_budget" in frame.columns
    assert list(summary["classes"]) == ["64", "128", "256", UNSOLVED]
    assert [c["n"] for c in summary["classes"].values()] == [2, 2, 2, 2]
    assert summary["classes"]["256"]["mean"]["estimate"] == pytest.approx(265.0)
    assert summary["classes"][UNSOLVED]["median"]["estimate"] == pytest.approx(400.0)
    # capacity rises with B* over the solved problems: rho of 6 points in 3 tied classes
    rho = summary["spearman_bstar_capacity"]
    expected = spearman([64, 64, 128, 128, 256, 256], [105, 95, 160, 160, 280, 250])
    assert rho["estimate"] == pytest.approx(expected) and expected > 0.8
    assert rho["clusters"] == 6 and rho["low"] <= rho["estimate"] <= rho["high"]
    assert (out / "capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| Unsolved | 2 |" in table and "Spearman rho(B*, capacity)" in table
    chosen = capacity_study(sweep, evaluation, tmp_path / "budget", field="avg_kv_budget")
    assert chosen["classes"]["64"]["mean"]["estimate"] == pytest.approx(144.0)
    assert "avg_kv_allocated" in chosen["spearman_other_fields"]


def test_capacity_bootstrap_interval_shrinks_with_more_problems(tmp_path):
    from analysis.capacity import summarize_capacity

    gen = np.random.default_rng(0)

    def width(n: int) -> float:
        b = gen.choice([64, 128, 256], size=n)
        frame = pd.DataFrame({"uid": [f"p{i}" for i in range(n)], "b_star": b.astype(str),
                              "b_star_tokens": b.astype(float),
                              "capacity": b + gen.normal(0, 80, size=n), "samples": 1})
        rho = summarize_capacity(frame, [64, 128, 256])["spearman_bstar_capacity"]
        return rho["high"] - rho["low"]

    assert width(200) < width(12)


def test_capacity_study_rejects_inputs_that_cannot_be_joined(tmp_path):
    from analysis.capacity import capacity_study

    sweep = _sweep_tree(tmp_path, SWEEP_CORRECT)
    other = _growpage_tree(tmp_path / "a", {"amc23/50": [100.0], "amc23/51": [120.0]})
    with pytest.raises(ValueError, match="share no problem"):
        capacity_study(sweep, other, tmp_path / "o1")
    unsolved_only = _growpage_tree(tmp_path / "b", {"amc23/6": [100.0], "amc23/7": [120.0]})
    with pytest.raises(ValueError, match="every one of the 2 common problems is Unsolved"):
        capacity_study(sweep, unsolved_only, tmp_path / "o2")
    wrong_task = _growpage_tree(tmp_path / "c", {"amc23/0": [100.0]}, task="aime24")
    with pytest.raises(ValueError, match="task 'amc23' but the eval of task 'aime24'"):
        capacity_study(sweep, wrong_task, tmp_path / "o3")
    with pytest.raises(ValueError, match="no sweep.csv"):
        capacity_study(tmp_path / "nowhere", other, tmp_path / "o4")
    with pytest.raises(ValueError, match="is not a result directory"):
        capacity_study(sweep, tmp_path / "nowhere", tmp_path / "o5")
    no_field = _growpage_tree(tmp_path / "d", {"amc23/0": [100.0]}, field="something_else")
    with pytest.raises(ValueError, match="no sample has a capacity field"):
        capacity_study(sweep, no_field, tmp_path / "o6")


def test_analyze_capacity_command_prints_the_table_and_names_bad_input(tmp_path):
    from typer.testing import CliRunner

    from analysis.cli import analyze_app

    sweep = _sweep_tree(tmp_path, SWEEP_CORRECT)
    evaluation = _growpage_tree(tmp_path, {"amc23/0": [100.0], "amc23/2": [150.0],
                                           "amc23/4": [300.0], "amc23/7": [310.0]})
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(analyze_app, ["capacity", "--sweep", str(sweep / "sweep.csv"),
                                         "--eval", str(evaluation), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 128 | 1 |" in result.output and (out / "summary.json").exists()
    bad = runner.invoke(analyze_app, ["capacity", "--sweep", str(tmp_path / "nope"),
                                      "--eval", str(evaluation), "--out", str(out)])
    assert bad.exit_code == 2 and "no sweep.csv" in " ".join(bad.output.split())
