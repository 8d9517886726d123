import gzip
import json
import math

import numpy as np
import pytest

from trace.reporting.warmups import pool_units, warmup_components


def test_warmup_components_against_a_hand_worked_split():
    # warmup 0: 1, 2, 3 (mean 2); warmup 1: 3, 4, 5 (mean 4); grand mean 3
    # MS between = 3 * ((2-3)^2 + (4-3)^2) / 1 = 6; MS within = (1+0+1 + 1+0+1) / (6-2) = 1
    # n0 = (6 - 18/6) / 1 = 3; warmup variance = (6 - 1) / 3 = 5/3; F = 6 on (1, 4)
    c = warmup_components({0: [1.0, 2.0, 3.0], 1: [3.0, 4.0, 5.0]})
    assert c.means == {0: 2.0, 1: 4.0} and c.grand_mean == 3.0
    assert (c.ms_between, c.ms_within, c.f) == pytest.approx((6.0, 1.0, 6.0))
    assert c.var_warmup == pytest.approx(5 / 3) and c.var_seed == pytest.approx(1.0)
    assert c.warmup_share == pytest.approx((5 / 3) / (5 / 3 + 1))
    assert c.p == pytest.approx(0.0705, abs=5e-4)  # F(1, 4) upper tail at 6


def test_warmup_components_unbalanced_and_without_a_warmup_effect():
    # n = (2, 4): n0 = (6 - 20/6) / 1 = 8/3; equal means -> no between-warmup variance
    c = warmup_components({0: [0.0, 2.0], 1: [-1.0, 3.0, 0.0, 2.0]})
    assert c.ms_between == pytest.approx(0.0) and c.var_warmup == 0.0 and c.warmup_share == 0.0
    assert c.p == pytest.approx(1.0)
    # means 1 and 4, grand 3: MS between = 2*4 + 4*1 = 12, MS within = 4/4 = 1, n0 = 6 - 20/6 = 8/3
    c = warmup_components({0: [0.0, 2.0], 1: [3.0, 5.0, 4.0, 4.0]})
    assert (c.ms_between, c.ms_within) == pytest.approx((12.0, 1.0))
    assert c.var_warmup == pytest.approx(11 / (8 / 3))


def test_warmup_components_recovers_a_simulated_warmup_variance():
    rng = np.random.default_rng(0)
    estimates = []
    for _ in range(400):
        effects = rng.normal(0.0, 0.02, size=8)  # sd warmup 0.02, sd seed 0.01, 8 warmups x 3 seeds
        estimates.append(warmup_components({w: e + rng.normal(0.0, 0.01, size=3)
                                            for w, e in enumerate(effects)}).var_warmup)
    assert np.mean(estimates) == pytest.approx(0.02 ** 2, rel=0.15)


@pytest.mark.parametrize("values", [{0: [1.0, 2.0]}, {0: [1.0], 1: []}, {0: [1.0], 1: [2.0]}])
def test_warmup_components_refuses_what_cannot_split(values):
    with pytest.raises(ValueError, match="warmup_components needs"):
        warmup_components(values)


def test_pool_units_numbers_warmups_then_seeds_and_keeps_each_unit_paired():
    per_warmup = {1: {"grpo": {0: "g10", 2: "g12"}, "trace": {0: "t10", 2: "t12"}},
                  0: {"grpo": {0: "g00", 2: "g02"}, "trace": {0: "t00", 2: "t02"}}}
    pooled, units = pool_units(per_warmup)
    assert units == [{"unit": 0, "warmup_seed": 0, "seed": 0}, {"unit": 1, "warmup_seed": 0, "seed": 2},
                     {"unit": 2, "warmup_seed": 1, "seed": 0}, {"unit": 3, "warmup_seed": 1, "seed": 2}]
    assert pooled == {"grpo": {0: "g00", 1: "g02", 2: "g10", 3: "g12"},
                      "trace": {0: "t00", 1: "t02", 2: "t10", 3: "t12"}}
    with pytest.raises(ValueError, match="warmup 1 has arms and seeds"):
        pool_units({0: {"grpo": {0: 1, 1: 1}}, 1: {"grpo": {0: 1}}})


def _result(rng, base: float, num_questions: int = 40, k: int = 4) -> dict:
    greedy = {f"q{i}": float(rng.random() < base) for i in range(num_questions)}
    sampled = {f"q{i}": float(rng.binomial(k, base) / k) for i in range(num_questions)}
    return {"run_id": "r", "experiment_id": "e", "history": {}, "summary": {"arm/mean_effective_ratio": base},
            "machine": {}, "eval": {"accuracy/greedy": float(np.mean(list(greedy.values()))),
                                    f"accuracy/mean_at_{k}": float(np.mean(list(sampled.values())))},
            "questions": greedy, "sampled_questions": sampled}


def test_the_study_pools_warmups_into_one_report_and_splits_the_warmup_effect(tmp_path):
    from scripts.warmup_study import STUDY_KEYS, pool

    rng = np.random.default_rng(1)
    study = {k: None for k in STUDY_KEYS}
    study.update({"evaluate.pass_k": 4, "report.margin": 0.02, "evaluate.num_prompts": 40})
    for w, shift in ((0, 0.0), (1, 0.2)):  # trace beats grpo by 0.2 from warmup 1 only
        results = {"grpo": {s: _result(rng, 0.4) for s in range(3)},
                   "trace": {s: _result(rng, 0.4 + shift) for s in range(3)}}
        warmup = {"accuracy/greedy": 0.3, "accuracy/mean@4": 0.25, "warmup/chosen_step": 900 + 50 * w}
        (tmp_path / f"w{w}").mkdir()
        (tmp_path / f"w{w}" / "results.json.gz").write_bytes(gzip.compress(json.dumps({
            "warmup_seed": w, "commit": "abc1234", "study": study, "warmup": warmup, "warmup_questions": None,
            "results": {a: {str(s): r for s, r in by.items()} for a, by in results.items()}}).encode()))
    payload = pool(tmp_path)
    assert [u["warmup_seed"] for u in payload["units"]] == [0, 0, 0, 1, 1, 1]
    assert payload["ablations"]["trace"]["vs_grpo"]["eval mean@k"]["n"] == 6  # paired over the six units
    assert json.loads((tmp_path / "metrics.json").read_text())["ablations"] == payload["ablations"]
    comp = payload["warmup_components"]["trace"]
    assert comp["means"]["1"] - comp["means"]["0"] == pytest.approx(0.2, abs=0.08)
    assert comp["warmup_share"] > 0.5 and comp["p"] < 0.05
    text = (tmp_path / "summary.md").read_text()
    assert "## Warmups" in text and "| 1 | abc1234 | 950 | 0.300 | 0.250 |" in text
    assert not math.isnan(payload["warmups"]["1"]["arms"]["trace"]["vs_grpo"]["eval mean@k"]["mean"])


def test_a_study_of_one_seed_per_warmup_pools_without_the_split(tmp_path):
    from scripts.warmup_study import STUDY_KEYS, pool

    rng = np.random.default_rng(2)
    study = {k: None for k in STUDY_KEYS} | {"evaluate.pass_k": 4, "report.margin": 0.02, "evaluate.num_prompts": 40}
    for w in (0, 1):
        (tmp_path / f"w{w}").mkdir()
        (tmp_path / f"w{w}" / "results.json.gz").write_bytes(gzip.compress(json.dumps({
            "warmup_seed": w, "commit": "abc1234", "study": study, "warmup": {"accuracy/greedy": 0.3},
            "warmup_questions": None, "results": {a: {"0": _result(rng, 0.4)} for a in ("grpo", "trace")}}).encode()))
    payload = pool(tmp_path)
    assert payload["ablations"]["trace"]["vs_grpo"]["eval mean@k"]["n"] == 2 and payload["warmup_components"] == {}
    assert "## Warmups" in (tmp_path / "summary.md").read_text()


def test_the_study_refuses_warmups_of_different_studies(tmp_path):
    from scripts.warmup_study import STUDY_KEYS, load_warmups

    for w, steps in ((0, 160), (1, 80)):
        (tmp_path / f"w{w}").mkdir()
        study = {k: None for k in STUDY_KEYS} | {"train.num_steps": steps}
        (tmp_path / f"w{w}" / "results.json.gz").write_bytes(gzip.compress(json.dumps(
            {"warmup_seed": w, "study": study, "results": {}}).encode()))
    with pytest.raises(ValueError, match=r"warmup 1 differs from warmup 0 in \{'train.num_steps': \(160, 80\)\}"):
        load_warmups(tmp_path)
    with pytest.raises(FileNotFoundError, match="no .*w\\*/results.json"):
        load_warmups(tmp_path / "empty")


def test_the_docs_table_reads_the_pooled_study(tmp_path):
    from pathlib import Path

    from scripts.docs_tables_common import Context
    from scripts.docs_tables_warmups import warmups_table

    folder = tmp_path / "reports" / "runs" / "paper-x"
    folder.mkdir(parents=True)
    test_the_study_pools_warmups_into_one_report_and_splits_the_warmup_effect(folder)
    study = json.loads((folder / "study.json").read_text())
    text = warmups_table(Context(root=tmp_path, doc=tmp_path / "README.md", index={"paper-warmups": "paper-x"}))
    assert "| 1 | 950 | 0.300 | 0.250 |" in text  # the warmup's metrics as the stage writes them
    c = study["warmup_components"]["trace"]
    assert f"| {math.sqrt(c['var_warmup']):.3f} | {math.sqrt(c['var_seed']):.3f} | {c['warmup_share']:.2f} |" in text
    w1 = study["warmups"]["1"]["arms"]["trace"]["vs_grpo"]["eval mean@k"]
    assert f"{w1['mean']:+.3f} [{w1['low']:+.3f}, {w1['high']:+.3f}]" in text
    assert "No committed report yet" in warmups_table(Context(root=tmp_path, doc=Path("README.md"),
                                                              index={"paper-warmups": None}))
