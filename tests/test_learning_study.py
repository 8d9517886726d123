"""scripts.learning_study: candidates from the command line, and the summary of finished runs (no training here)."""

import math

import pytest

from scripts.learning_study import DEFAULT_CANDIDATES, main, markdown, parse_candidates, summarize
from trace.configuration.config import ConfigError

WARMUP = {"q0": 0.0, "q1": 0.0, "q2": 1.0, "q3": 1.0}


def row(name, seed, rewards, probe_gain=0.01, overrides=None):
    return {"candidate": name, "seed": seed, "overrides": overrides or {}, "held_out": dict(zip(sorted(WARMUP), rewards)),
            "probe_gain": probe_gain, "train_reward_last10": 0.5}


def test_no_candidate_given_runs_the_built_in_list_with_the_reference_first():
    assert parse_candidates(None) == DEFAULT_CANDIDATES
    assert next(iter(DEFAULT_CANDIDATES)) == "default" and DEFAULT_CANDIDATES["default"] == {}


def test_candidates_read_their_overrides_as_yaml_values():
    got = parse_candidates([["neg", "advantages.negative_weight=0.25", "update.lr=6.0e-4"], ["ref"]])
    assert got == {"neg": {"advantages.negative_weight": 0.25, "update.lr": 6.0e-4}, "ref": {}}


@pytest.mark.parametrize("items, message", [
    ([["advantages.scale=none"]], "the first word is the candidate's name"),
    ([["a"], ["a", "update.lr=1e-4"]], "given twice"),
    ([["a", "update.lr"]], "must be KEY=VALUE"),
])
def test_a_malformed_candidate_is_refused_with_the_fix(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_candidates(items)


def test_an_unknown_only_name_lists_the_candidates():
    with pytest.raises(ConfigError, match=r"--only \['nope'\]: no such candidate.*'default'"):
        main(["--only", "nope"])


def test_summary_gains_are_paired_by_question_and_seed():
    rows = [row("default", 0, [1, 0, 1, 1]), row("default", 1, [0, 0, 1, 1]),  # gains 0.25, 0
            row("neg", 0, [1, 1, 1, 1], 0.05), row("neg", 1, [1, 1, 1, 1], 0.07),  # gains 0.5, 0.5
            row("late", 2, [1, 1, 1, 1])]  # a seed the reference does not have
    summary = summarize(rows, ["default", "neg", "late", "absent"], WARMUP)
    assert list(summary) == ["default", "neg", "late"]  # a candidate without rows is left out
    assert summary["default"]["held_out_gain"]["mean"] == pytest.approx(0.125)
    assert summary["default"]["vs_reference"] is None
    assert summary["neg"]["held_out_gain"]["mean"] == pytest.approx(0.5)
    # neg minus default, per seed and question: s0 [0, 1, 0, 0], s1 [1, 1, 0, 0] -> mean 3 / 8
    assert summary["neg"]["vs_reference"]["mean"] == pytest.approx(0.375)
    assert summary["neg"]["probe_gain_mean"] == pytest.approx(0.06) and summary["neg"]["probe_gains"] == [0.05, 0.07]
    assert summary["late"]["vs_reference"] is None and summary["late"]["seeds"] == [2]
    assert math.isnan(summary["late"]["held_out_gain"]["low"])  # one seed: no interval


def test_summary_calls_a_gain_real_only_when_its_interval_excludes_zero():
    same = [row(n, s, [0, 0, 1, 1]) for n in ("default", "same") for s in (0, 1, 2)]
    summary = summarize(same, ["default", "same"], WARMUP)
    assert summary["same"]["vs_reference"]["real"] is False
    table = markdown(summary, "default")
    assert "+0.000 [+0.000, +0.000]* seeds [+0.000, +0.000] within noise" in table and "(params.yaml)" in table
    up = [row("default", s, [0, 0, 0, 0]) for s in (0, 1, 2)] + [row("up", s, [1, 1, 1, 1]) for s in (0, 1, 2)]
    summary = summarize(up, ["default", "up"], WARMUP)
    assert summary["up"]["vs_reference"]["real"] is True and summary["up"]["vs_reference"]["low"] == 1.0
    assert "+1.000 [+1.000, +1.000]* seeds [+1.000, +1.000] real" in markdown(summary, "default")


def test_a_seed_interval_that_includes_zero_decides_and_is_starred():
    # per-seed differences 0.5, 0.25, 0.75 of "mixed" minus the reference: the t-interval over 3 seeds
    # [-0.121, +1.121] has the larger p (0.074), so it decides
    rows = ([row("default", s, [0, 0, 0, 0]) for s in (0, 1, 2)]
            + [row("mixed", 0, [1, 1, 0, 0]), row("mixed", 1, [1, 0, 0, 0]), row("mixed", 2, [1, 1, 1, 0])])
    d = summarize(rows, ["default", "mixed"], WARMUP)["mixed"]["vs_reference"]
    assert d["seed_low"] == pytest.approx(-0.121, abs=1e-3) and d["deciding"] == "t" and d["real"] is False
    assert d["p"] == pytest.approx(0.074, abs=1e-3)
    text = markdown(summarize(rows, ["default", "mixed"], WARMUP), "default")
    assert f"seeds [{d['seed_low']:+.3f}, {d['seed_high']:+.3f}]* within noise" in text


def avgk_row(name, seed, greedy, avgk):
    out = row(name, seed, greedy)
    out["held_out_avgk"] = dict(zip(sorted(WARMUP), avgk))
    return out


def test_avgk_differences_get_the_margin_verdict_of_their_hull():
    warmup_avgk = {"q0": 0.25, "q1": 0.25, "q2": 0.75, "q3": 0.75}
    ref = [avgk_row("default", s, [0, 0, 1, 1], [0.5, 0.5, 0.75, 0.75]) for s in (0, 1, 2)]
    same = [avgk_row("bf16", s, [0, 0, 1, 1], [0.5 + d, 0.5, 0.75, 0.75 - d])
            for s, d in ((0, 0.0), (1, 0.005), (2, -0.005))]
    far = [avgk_row("far", s, [0, 0, 1, 1], [0.5 - 0.25 * (s + 1), 0.5, 0.75, 0.75]) for s in (0, 1, 2)]
    summary = summarize(ref + same + far, ["default", "bf16", "far"], WARMUP, warmup_avgk, margin=0.02)
    assert summary["default"]["avgk_gain"]["mean"] == pytest.approx(0.125)
    assert summary["default"]["avgk_vs_reference"] is None
    assert summary["bf16"]["avgk_vs_reference"]["mean"] == pytest.approx(0.0)
    assert summary["bf16"]["avgk_vs_reference"]["margin_verdict"] == "equivalent within ±delta"
    far_d = summary["far"]["avgk_vs_reference"]
    assert far_d["mean"] == pytest.approx(-0.125) and far_d["margin_verdict"] in ("worse", "undecided")
    # the greedy difference of identical policies: no margin verdict is read as a claim of equivalence there
    assert summary["bf16"]["vs_reference"]["margin_verdict"] == "equivalent within ±delta"
    table = markdown(summary, "default")
    assert "avg@k minus `default`" in table and "; equivalent within ±delta" in table
    # without avg@K the table has no such columns
    assert "avg@k" not in markdown(summarize(ref, ["default"], WARMUP), "default")
