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
    assert "+0.000 [+0.000, +0.000] within noise" in table and "(params.yaml)" in table
    up = [row("default", s, [0, 0, 0, 0]) for s in (0, 1, 2)] + [row("up", s, [1, 1, 1, 1]) for s in (0, 1, 2)]
    summary = summarize(up, ["default", "up"], WARMUP)
    assert summary["up"]["vs_reference"]["real"] is True and summary["up"]["vs_reference"]["low"] == 1.0
    assert "+1.000 [+1.000, +1.000] real" in markdown(summary, "default")
