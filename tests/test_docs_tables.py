"""The results and benchmarks tables of README.md and docs/ are what the committed reports say
(``scripts/docs_tables.py``): a number edited by hand, or a report re-run without the docs, fails here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from scripts import docs_tables
from scripts.docs_tables import DocsTableError, read_index, render, update

REPO = Path(__file__).resolve().parents[1]


def test_every_docs_table_matches_the_committed_reports():
    stale = update(REPO, check=True)
    assert not stale, ("tables differ from the committed reports (run `python -m scripts.docs_tables` and commit "
                       f"the result): {stale}")


def test_the_readme_and_docs_hold_the_results_tables():
    """The front door shows the default and learning runs, every arm, the presets and the benchmarks; docs/ the rest
    (the paired tables among it)."""
    readme = (REPO / "README.md").read_text()
    for name in ("default-arms", "paper-warmups-primary", "all-arms-overview",
                 "presets", "benchmarks"):
        assert f"<!-- table:{name} -->" in readme, name
    results = (REPO / "docs" / "results.md").read_text()
    for name in ("default-arms-full", "default-vs-grpo-full", "paper-regime", "paper-gain-avgk", "paper-arms-full",
                 "paper-vs-grpo-full", "paper-tokens-to-target-avgk", "paper-tokens-to-target", "paper-audit",
                 "long-arms-full", "long-vs-grpo-full", "paper-warmups-primary", "paper-warmups-components",
                 "paper-w0-gain-avgk", "paper-w1-tokens-to-target-avgk",
                 "long-audit", "preset-hotpotqa",
                 "preset-gsm8k", "preset-bfcl"):
        assert f"<!-- table:{name} -->" in results, name
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    for name in ("benchmarks", "benchmark-runs", "allocation-quality", "allocation-objectives", "real-task-step"):
        assert f"<!-- table:{name} -->" in benchmarks, name


def test_index_names_committed_report_folders():
    index = read_index(REPO)
    assert set(index) == set(docs_tables.ABLATION_REPORTS + docs_tables.PRESET_REPORTS)
    for key, folder in index.items():
        if folder is not None:
            assert (REPO / "reports" / "runs" / folder / "metrics.json").is_file(), key


@pytest.fixture
def repo_copy(tmp_path):
    """The reports, the index and one Markdown file with tables, in a scratch repository."""
    shutil.copytree(REPO / "reports", tmp_path / "reports")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("# page\n\n<!-- table:long-vs-grpo -->\n<!-- /table:long-vs-grpo -->\n\ntext after\n"
                   "<!-- table:default-arms -->\nold\n<!-- /table:default-arms -->\n")
    return tmp_path, doc


def test_a_number_changed_by_hand_names_its_table(repo_copy):
    root, doc = repo_copy
    update(root)
    assert update(root, check=True) == []
    text = doc.read_text()
    assert "+0.179 t [+0.117, +0.241]* real after correction" in text  # trace minus grpo, effective ratio, long-62d82c7
    doc.write_text(text.replace("+0.179 t [+0.117, +0.241]", "+0.189 t [+0.117, +0.241]"))
    assert update(root, check=True) == ["docs/page.md: long-vs-grpo"]
    assert "+0.189" in doc.read_text()  # --check writes nothing
    update(root)
    assert "+0.179 t [+0.117, +0.241]* real after correction" in doc.read_text()
    assert doc.read_text().endswith("default-arms -->\n")
    assert "text after" in doc.read_text()


def test_a_changed_report_makes_its_tables_stale(repo_copy):
    root, doc = repo_copy
    update(root)
    path = root / "reports" / "runs" / "long-62d82c7" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["ablations"]["trace"]["vs_grpo"]["effective ratio"]["mean"] = 0.2
    path.write_text(json.dumps(metrics))
    assert update(root, check=True) == ["docs/page.md: long-vs-grpo"]


def test_switching_the_default_report_is_one_line_of_the_index(repo_copy):
    root, doc = repo_copy
    index = root / "reports" / "runs" / "index.yaml"
    lines = index.read_text().splitlines(keepends=True)
    default = next(i for i, line in enumerate(lines) if line.startswith("default:"))
    lines[default] = "default: null\n"
    index.write_text("".join(lines))
    update(root)
    assert "No committed report yet" in doc.read_text()
    lines[default] = "default: long-62d82c7\n"
    index.write_text("".join(lines))
    assert update(root) == ["docs/page.md: default-arms"]
    assert "| as `grpo` | `grpo` | 0.598 ± 0.050 |" in doc.read_text()


def test_an_unknown_table_name_is_an_error_listing_the_known_ones(tmp_path):
    doc = tmp_path / "page.md"
    with pytest.raises(DocsTableError, match="unknown table 'long-armz'.*long-arms"):
        render("<!-- table:long-armz -->\n<!-- /table:long-armz -->\n", doc, REPO, read_index(REPO))


def test_an_unclosed_marker_is_an_error(tmp_path):
    doc = tmp_path / "page.md"
    with pytest.raises(DocsTableError, match="do not pair up"):
        render("<!-- table:long-arms -->\nno end\n", doc, REPO, read_index(REPO))


def test_an_index_entry_without_a_committed_report_is_an_error(repo_copy):
    root, _ = repo_copy
    index = root / "reports" / "runs" / "index.yaml"
    index.write_text(index.read_text().replace("long: long-62d82c7", "long: long-0000000"))
    with pytest.raises(DocsTableError, match="long-0000000/metrics.json does not exist"):
        read_index(root)


def test_the_check_command_exits_1_naming_the_stale_table(repo_copy, monkeypatch, capsys):
    root, doc = repo_copy
    update(root)
    doc.write_text(doc.read_text().replace("+0.179", "+0.180"))
    monkeypatch.setattr(docs_tables, "REPO_ROOT", root)
    assert docs_tables.main(["--check"]) == 1
    assert "docs/page.md: long-vs-grpo: differs from the committed reports" in capsys.readouterr().out


def _accuracy_report(root: Path, grpo_greedy: dict, hits: dict) -> docs_tables.Context:
    """A scratch report under key ``paper``: warmup 0.500, grpo's final in-training accuracies 0.60/0.62/0.64."""
    seeds = {f"s{i}": {"arm/last_eval_acc": acc} for i, acc in enumerate((0.60, 0.62, 0.64))}
    ablations = {
        "grpo": {"mean": {"eval greedy": grpo_greedy}, "tokens_to_grpo_final": hits["grpo"], **seeds},
        "trace": {"mean": {"eval greedy": {"mean": 0.55, "low": 0.49, "high": 0.61, "n": 3}},
                  "tokens_to_grpo_final": hits["trace"], **seeds},
    }
    folder = root / "reports" / "runs" / "paper-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {"accuracy/greedy": 0.5}}))
    return docs_tables.Context(root=root, doc=root / "README.md", index={"paper": "paper-x"})


def test_the_greedy_gain_table_names_no_learning_bar(tmp_path):
    """One learning bar, asked of avg@k in the -gain-avgk table; the greedy table only points to it."""
    ctx = _accuracy_report(tmp_path, {"mean": 0.62, "low": 0.55, "high": 0.69, "n": 3}, {"grpo": None, "trace": None})
    text = docs_tables.gain_table(ctx, "paper")
    assert "| `trace` | 0.550 ± 0.060 | +0.050 [-0.010, +0.110] | no |" in text
    assert "**met**" not in text and "**not met**" not in text


def test_a_report_without_censored_crossings_says_not_recorded_and_a_target_below_the_warmup_is_refused(tmp_path):
    hits = {"grpo": {"mean": 40000.0, "low": 30000.0, "high": 50000.0, "n": 3},
            "trace": {"mean": 25000.0, "n": 1}}
    ctx = _accuracy_report(tmp_path, {"mean": 0.62, "low": 0.55, "high": 0.69, "n": 3}, hits)
    text = docs_tables.tokens_to_target_table(ctx, "paper")
    assert text.startswith("Tokens to a target greedy accuracy: not recorded.") and "25,000" not in text
    # grpo's finals 0.60 / 0.62 / 0.64 (mean 0.620) against a warmup of 0.670: the old target is degenerate
    path = tmp_path / "reports" / "runs" / "paper-x" / "metrics.json"
    metrics = json.loads(path.read_text())
    metrics["warmup"]["accuracy/greedy"] = 0.67
    path.write_text(json.dumps(metrics))
    refused = docs_tables.tokens_to_target_table(ctx, "paper")
    assert refused.startswith("Tokens to a target greedy accuracy: refused.") and "0.620" in refused \
        and "below the warmup's 0.670" in refused


def test_the_tokens_table_shows_censored_seeds_and_the_median(tmp_path):
    entry = {"target": 0.485, "reached": {"s0": 1000.0, "s1": 3000.0}, "censored": {"s2": 5000.0}, "median": 3000.0}
    ablations = {"grpo": {"mean": {}, "tokens_to_target": entry, "s0": {}, "s1": {}, "s2": {}}}
    folder = tmp_path / "reports" / "runs" / "paper-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"paper": "paper-x"})
    text = docs_tables.tokens_to_target_table(ctx, "paper")
    assert "| `grpo` | 3,000 | 2/3 | s0: 1,000, s1: 3,000, s2: > 5,000 (censored) |" in text
    entry2 = {"target": 0.6, "refused": "the target 0.600 is at or below the warmup's 0.670: ..."}
    ablations["grpo"]["tokens_to_target"] = entry2
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    assert "refused by the report, the target 0.600 is at or below" in docs_tables.tokens_to_target_table(ctx, "paper")


@pytest.mark.parametrize("gain, real, verdict", [
    (0.12, True, "met"),       # +0.12, both intervals exclude 0
    (0.08, True, "not met"),   # real but below the bar
    (0.12, False, "not met"),  # the bar's size, but an interval reaches 0
])
def test_the_avg_at_k_gain_table_judges_the_learning_bar_on_the_bootstrap_and_the_seed_interval(tmp_path, gain, real,
                                                                                               verdict):
    def boot(mean: float, is_real: bool) -> dict:
        return {"mean": mean, "low": mean - 0.03, "high": mean + 0.03, "n": 3, "estimator": "bootstrap",
                "seed_interval": {"mean": mean, "low": mean - (0.02 if is_real else 0.2), "high": mean + 0.02, "n": 3,
                                  "estimator": "t"}, "real": is_real}

    seeds = {f"s{i}": {"eval/accuracy/pass_at_8": 0.7} for i in range(3)}
    ablations = {
        "grpo": {"mean": {"eval greedy": {"mean": 0.70, "low": 0.68, "high": 0.72, "n": 3},
                          "eval mean@k": {"mean": 0.43 + gain, "low": 0.42 + gain, "high": 0.44 + gain, "n": 3}},
                 "vs_warmup": {"eval mean@k": boot(gain, real), "eval greedy": boot(0.03, False)}, **seeds},
    }
    folder = tmp_path / "reports" / "runs" / "paper-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {
        "accuracy/greedy": 0.67, "accuracy/mean@8": 0.43}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"paper": "paper-x"})
    text = docs_tables.gain_avgk_table(ctx, "paper")
    assert "| arm | held-out avg@8 | avg@8 minus warmup | held-out greedy | greedy minus warmup |" in text
    t_low = gain - (0.02 if real else 0.2)
    # both intervals shown, the deciding one starred (the t over 3 seeds: its p is the larger, 2 df against the
    # bootstrap's normal); a family of two gains, corrected by Holm
    decided = f"b [{gain - 0.03:+.3f}, {gain + 0.03:+.3f}] t [{t_low:+.3f}, {gain + 0.02:+.3f}]*"
    assert (f"| `grpo` | {0.43 + gain:.3f} ± 0.010 | {gain:+.3f} {decided} "
            f"{'real after correction' if real else 'within noise'} | 0.700 ± 0.020 | ") in text
    assert "(avg@8 0.430, greedy 0.670)" in text and f"gain >= 0.10, real after correction), is **{verdict}**;" in text
    # one bar, asked of avg@k; greedy's gain stands beside it, not as a second bar
    assert "`grpo`'s greedy gain is +0.030 (within noise)" in text and text.count("**") == 2


def test_the_legends_under_the_difference_tables_state_the_rule_the_labels_follow():
    """Every legend of a difference table in README.md and docs/results.md states the rule its labels follow
    (every interval must exclude 0, the deciding one marked, Holm within the family), never the single-interval
    rule that contradicted them."""
    from scripts.docs_tables_runs import RULE

    for doc in (REPO / "README.md", REPO / "docs" / "results.md"):
        text = doc.read_text()
        bodies = re.findall(r"<!-- table:([\w.-]*(?:vs-grpo|vs-trace|overview|primary|gain-avgk)[\w-]*) -->\n(.*?)<!-- /table",
                            text, re.DOTALL)
        assert bodies, doc
        for name, body in bodies:
            if "No committed report" in body:
                continue
            assert RULE in body, f"{doc.name}: {name}"
            assert "real only when the interval excludes 0" not in body, f"{doc.name}: {name}"
        assert "learning bar is **" not in text.replace("The learning bar, asked of avg@8 only", "")


def test_every_result_number_the_prose_quotes_is_in_a_committed_report():
    from scripts.docs_numbers import unsourced_numbers

    assert unsourced_numbers(REPO) == []


def test_a_hand_typed_result_in_the_prose_is_caught(repo_copy):
    from scripts.docs_numbers import report_numbers, unsourced_numbers

    root, _ = repo_copy
    known = report_numbers(root)
    typed = next(f"0.{k:04d}" for k in range(9183, 10000) if f"0.{k:04d}" not in known)  # in no report
    assert "0.018" in known
    (root / "README.md").write_text(f"# trace\n\n`grpo` gains +0.018 (a report's number); `trace` reached {typed}.\n")
    assert unsourced_numbers(root) == [("README.md", typed)]


def test_the_avg_at_k_tokens_table_of_a_report_with_only_grpos_final_crossings_says_not_recorded(tmp_path):
    # grpo's final in-training avg@k 0.52 / 0.54 / 0.56 (mean 0.540), the second seed under the earlier metric name
    seeds = {"s0": {"arm/last_avgk": 0.52}, "s1": {"arm/last_eval_avgk": 0.54}, "s2": {"arm/last_avgk": 0.56}}
    ablations = {"grpo": {"mean": {}, "tokens_to_grpo_final_sampled": {"mean": 300000.0, "low": 250000.0,
                                                                       "high": 350000.0, "n": 3}, **seeds},
                 "trace": {"mean": {}, "tokens_to_grpo_final_sampled": None, **seeds}}
    folder = tmp_path / "reports" / "runs" / "paper-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {"accuracy/mean@8": 0.43}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"paper": "paper-x"})
    text = docs_tables.tokens_to_target_table(ctx, "paper", sampled=True)
    assert text.startswith("Tokens to a target avg@k: not recorded.") and "300,000" not in text


def test_the_allocators_table_reads_the_simulator_ratio_and_the_default_task_differences(tmp_path):
    from scripts.docs_tables_allocators import ALLOCATORS, allocators_table

    (tmp_path / "reports" / "benchmarks").mkdir(parents=True)
    ratio = {"mean": 1.26, "low": 1.19, "high": 1.33, "n": 5}
    (tmp_path / "reports" / "benchmarks" / "allocation_quality.json").write_text(json.dumps(
        {"results": {"headline": {"allocators_on_one_budget": {"mopps": {"ratio_vs_grpo": ratio}}}}}))
    folder = tmp_path / "reports" / "runs" / "all-arms-x"
    folder.mkdir(parents=True)
    diff = {"mean": 0.12, "low": 0.05, "high": 0.19, "n": 3, "real": True}
    (folder / "metrics.json").write_text(json.dumps({"ablations": {
        "grpo": {"mean": {"trajectories/step": {"mean": 128.0, "n": 3}}},
        "mopps": {"mean": {"trajectories/step": {"mean": 128.0, "n": 3}},
                  "vs_grpo": {"effective ratio": diff,
                              "eval mean@k": {"mean": -0.01, "low": -0.04, "high": 0.02, "n": 3, "real": False}},
                  "allocator_state": {"mopps/selected_seen": {"mean": 0.61, "n": 3},
                                      "mopps/known_prompts": {"mean": 812.4, "n": 3}}},
        "greso": {"mean": {"trajectories/step": {"mean": 128.0, "n": 3}}},
        "reinforce_ada": {"mean": {"trajectories/step": {"mean": 128.0, "n": 3}}}}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "docs" / "results.md", index={"all-arms": "all-arms-x"})
    rows = {line.split(" | ")[0][2:]: line for line in allocators_table(ctx).splitlines() if line.startswith("| `")}
    assert list(rows) == [f"`{arm}`" for arm in ALLOCATORS]
    assert rows["`mopps`"].endswith("| 128 | 0.61 of the chosen prompts seen before; 812 prompts with a posterior | "
                                    "predicts prompt difficulty online; faster training with far fewer rollouts "
                                    "| 1.26 [1.19, 1.33] | +0.120 t [+0.050, +0.190]* real after correction | "
                                    "-0.010 t [-0.040, +0.020]* within noise |")  # the report's rule and verdicts
    assert rows["`vip`"].endswith("| n/a | n/a | n/a |") and "| n/a | n/a | better sampling" in rows["`vip`"]
    assert "| 128 | not logged | up to 2.4x" in rows["`greso`"]  # a report without the state says so
    assert "| 128 | no state | faster convergence" in rows["`reinforce_ada`"]
    empty = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"all-arms": None})
    assert "No committed report yet" in allocators_table(empty)


def test_the_overview_table_gives_each_arm_its_measures_and_its_verdicts_against_grpo(tmp_path):
    boot = {"mean": -0.024, "low": -0.045, "high": -0.002, "n": 3, "estimator": "bootstrap", "real": False,
            "seed_interval": {"mean": -0.024, "low": -0.06, "high": 0.01, "n": 3, "estimator": "t"}}
    seeds = {f"s{i}": {"eval/accuracy/pass_at_8": 0.7} for i in range(3)}
    iv = lambda m, h: {"mean": m, "low": m - h, "high": m + h, "n": 3}
    ablations = {
        "grpo": {"mean": {"eval mean@k": iv(0.46, 0.01), "eval greedy": iv(0.67, 0.02),
                          "effective ratio": iv(0.57, 0.1), "generated tokens": iv(42975, 652)}, **seeds},
        "trace": {"mean": {"eval mean@k": iv(0.45, 0.01), "eval greedy": iv(0.66, 0.02),
                           "effective ratio": iv(0.71, 0.05), "generated tokens": iv(32396, 507)},
                  "vs_grpo": {"eval mean@k": boot, "eval greedy": {**iv(-0.005, 0.03), "real": False},
                              "effective ratio": {**iv(0.139, 0.19), "real": False},
                              "generated tokens": {**iv(-10579, 263), "real": True}}, **seeds},
    }
    folder = tmp_path / "reports" / "runs" / "all-arms-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"all-arms": "all-arms-x"})
    text = docs_tables.tables()["all-arms-overview"](ctx)
    assert text.startswith("| arm | held-out avg@8 | minus `grpo` | held-out greedy | minus `grpo` | effective ratio "
                           "| minus `grpo` | generated tokens | minus `grpo` |")
    assert "| `grpo` | 0.460 ± 0.010 |  | 0.670 ± 0.020 |  | 0.570 ± 0.100 |  | 42,975 ± 652 |  |" in text
    # a bootstrap interval that excludes 0 with a t-interval over seeds that does not: within noise, and the
    # legend says why
    # the seed t-interval decides (t), and its family of one keeps the tokens difference real after correction
    assert ("| `trace` | 0.450 ± 0.010 | -0.024 within noise (t) | 0.660 ± 0.020 | -0.005 within noise (t) | "
            "0.710 ± 0.050 | +0.139 within noise (t) | 32,396 ± 507 | -10,579 real after correction (t) |") in text
    assert "2 arms, grouped against `grpo`" in text and "* marks the interval that decided" in text


def test_the_audit_and_truth_tables_show_integrated_forecasts_and_the_unselected_scores(tmp_path):
    iv = lambda mean, half=0.0: {"mean": mean, "low": mean - half, "high": mean + half, "n": 3}  # noqa: E731
    audit = {"audit/expected_mixed_groups": iv(7.9), "audit/integrated_mixed_groups": iv(5.1, 0.2),
             "audit/mixed_groups": iv(5.0, 0.5), "audit/expected_flips": iv(34.0), "audit/integrated_flips": iv(12.0),
             "audit/flips": iv(11.0, 1.0), "truth/root_ece": iv(0.12, 0.01), "truth/root_auc": iv(0.55),
             "truth/prefix_resolution": iv(0.002), "truth/rollouts": iv(1536.0)}
    ablations = {"trace": {"mean": {}, "audit": audit, "flips_vs_random": iv(1.58, 0.36)},
                 "trace_oracle": {"mean": {}, "audit": {**audit, "oracle/rollouts": iv(2700.0)}},
                 "grpo": {"mean": {}, "audit": {"audit/mixed_groups": iv(5.5)}}}
    folder = tmp_path / "reports" / "runs" / "predictor-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"paper": "predictor-x"})
    text = docs_tables.audit_table(ctx, "paper")
    assert "| arm | expected mixed groups | integrated | mixed groups | expected flips | integrated | flips |" in text
    assert "| `trace` | 7.90 ± 0.00 | 5.10 ± 0.20 | 5.00 ± 0.50 | 34.00 ± 0.00 | 12.00 ± 0.00 | 11.00 ± 1.00 |" in text
    truth = docs_tables.truth_table(ctx, "paper")
    assert "| `trace` | root | 0.120 ± 0.010 | n/a | n/a | n/a | 0.550 ± 0.000 | n/a | n/a |" in truth
    assert "| `trace` | prefix | n/a | n/a | n/a | 0.002 ± 0.000 |" in truth
    assert "`grpo`" not in truth  # no truth logged: no row
    assert "the audit 1,536 per audited step; `trace_oracle`'s estimates 2,700 rollouts a step" in truth
    assert "mean over seeds [95 % t-interval]: `trace` 1.58 [1.22, 1.94]." in truth
    # a report from before the integrated forecasts keeps its four columns
    for arm in ablations.values():
        arm["audit"] = {k: v for k, v in arm["audit"].items() if "integrated" not in k}
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    assert "| arm | expected mixed groups | mixed groups | expected flips | flips |" in docs_tables.audit_table(ctx, "paper")


def test_the_calibration_table_pairs_the_recalibrated_run_with_the_predictors_own_by_seed(tmp_path):
    from scripts.docs_tables_predictor import calibration_table

    iv = lambda mean, half=0.0: {"mean": mean, "low": mean - half, "high": mean + half, "n": 3}  # noqa: E731

    def report(name: str, ece: list[float], auc: list[float], avgk: list[float]) -> None:
        entry = {"pooled_ece": {"root": sum(ece) / 3 - 0.01, "prefix": 0.06},
                 "pooled_ece_seeds": {"root": {f"s{s}": v for s, v in enumerate(ece)},
                                      "prefix": {"s0": 0.06, "s1": 0.06, "s2": 0.06}},
                 "audit": {"truth/root_ece": iv(0.12, 0.03), "truth/root_auc": iv(0.84)},
                 "audit_seeds": {"truth/root_auc": {f"s{s}": v for s, v in enumerate(auc)}},
                 **{f"s{s}": {"eval/accuracy/mean_at_8": v} for s, v in enumerate(avgk)}}
        folder = tmp_path / "reports" / "runs" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"ablations": {"trace": entry}, "warmup": {}}))

    report("own-x", [0.08, 0.10, 0.06], [0.80, 0.84, 0.88], [0.40, 0.42, 0.44])
    report("recal-x", [0.05, 0.06, 0.04], [0.80, 0.84, 0.88], [0.41, 0.42, 0.46])
    report("iso-x", [0.09, 0.12, 0.06], [0.81, 0.85, 0.89], [0.40, 0.42, 0.44])
    index = {"reliability": "own-x", "recalibrated": "recal-x", "isotonic": "iso-x"}
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index=index)
    text = calibration_table(ctx)
    assert "| the predictor's forecasts | root | 0.070 | s0 0.080, s1 0.100, s2 0.060 | 0.120 ± 0.030 | 0.840 ± 0.000 |" \
        in text
    # each map against the predictor's own, in the table's order; differences -0.03, -0.04, -0.02: mean -0.03,
    # t-interval -0.03 ± 4.303 * 0.01 / sqrt(3)
    platt, isotonic = text.split("The Platt map minus")[1].split("The isotonic map minus")
    assert "pooled ECE, roots -0.030 [-0.055, -0.005]" in platt and "AUC, roots +0.000 [+0.000, +0.000]" in platt
    assert "held-out avg@8 +0.010 [-0.015, +0.035]" in platt  # +0.01, 0, +0.02
    assert "pooled ECE, roots +0.010 [-0.015, +0.035]" in isotonic and "AUC, roots +0.010 [+0.010, +0.010]" in isotonic
    assert all(f"{name}/metrics.json" in text for name in index.values())
    for missing in ("recalibrated", "isotonic"):
        ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={**index, missing: None})
        assert "No committed report yet" in calibration_table(ctx)


def test_the_exploration_table_gives_the_debiased_ece_and_its_floor_and_refuses_reports_without_them(tmp_path):
    from scripts.docs_tables_predictor import EXPLORATION_REPORTS, exploration_table

    iv = lambda mean: {"mean": mean, "low": mean, "high": mean, "n": 3}  # noqa: E731
    seeds = {"s0": 0.05, "s1": 0.06, "s2": 0.04}
    entry = {"pooled_ece": {"root": 0.05, "prefix": 0.06}, "pooled_ece_seeds": {"root": seeds, "prefix": seeds},
             "pooled_ece_interval": {"root": {"low": 0.04, "high": 0.08}, "prefix": {"low": 0.05, "high": 0.09}},
             "debiased_ece": {"root": 0.043, "prefix": 0.051}, "ece_floor": {"root": 0.014, "prefix": 0.02},
             "debiased_ece_interval": {"root": {"low": 0.028, "high": 0.065}, "prefix": {"low": 0.03, "high": 0.07}},
             "audit": {"truth/root_auc": iv(0.7)},
             "audit_seeds": {k: seeds for k in ("audit/flips", "audit/mixed_groups", "audit/integrated_flips",
                                                "audit/integrated_mixed_groups")}}
    index = {}
    for n, key in enumerate(EXPLORATION_REPORTS):
        folder = tmp_path / "reports" / "runs" / f"run-{n}"
        folder.mkdir(parents=True)
        arms = {"trace": entry, **({"tree_random": entry} if n == 0 else {})}
        (folder / "metrics.json").write_text(json.dumps({"ablations": arms, "warmup": {}}))
        index[key] = f"run-{n}"
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index=index)
    text = exploration_table(ctx)
    assert "| exploration groups | stage | pooled ECE | debiased ECE | floor | per seed |" in text
    assert ("| none (`trace` as by default) | root | 0.050 [0.040, 0.080] | 0.043 [0.028, 0.065] | 0.014 | "
            "s0 0.050, s1 0.060, s2 0.040 |") in text
    stale = {k: v for k, v in entry.items() if k not in ("debiased_ece", "ece_floor", "debiased_ece_interval")}
    (tmp_path / "reports" / "runs" / "run-1" / "metrics.json").write_text(
        json.dumps({"ablations": {"trace": stale}, "warmup": {}}))
    assert f"The reports of `{list(EXPLORATION_REPORTS)[1]}` have no debiased ECE" in exploration_table(ctx)


def test_the_stages_table_pairs_each_arm_with_tree_random_by_seed_across_reports(tmp_path):
    from tests.test_reliability import _seed_audits
    from scripts.docs_tables_predictor import STAGE_ARMS, stages_table
    from trace.predictor.reliability import calibration_noise, compact_rows, debiased_ece_difference, pool_diagrams

    rng = np.random.default_rng(3)
    gaps = {"tree_random": 0.0, "trace": 0.08, "trace_prefix": 0.0, "trace_root": 0.08}
    audits = {(key, arm): _seed_audits(rng, 4, 0.0 if key == "exploration-weighted" else gaps[arm])
              for key, arms in STAGE_ARMS.items() for arm in arms}
    index = {}
    for key, arms in STAGE_ARMS.items():
        entries = {arm: {"audit_diagrams": {stage: {f"s{s}": [compact_rows(r) for r in runs]
                                                    for s, runs in audits[key, arm].items()}
                                            for stage in ("root", "prefix")}}
                   for arm in arms}
        if key == "stages":  # a fifth seed only one report holds is left out
            kept = entries["trace_root"]["audit_diagrams"]["root"]
            kept["s9"] = kept["s0"]
        folder = tmp_path / "reports" / "runs" / key
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"ablations": entries, "warmup": {}}))
        index[key] = key
        if key == "stages":
            stages_entries = entries
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "docs" / "results.md", index=index)
    text = stages_table(ctx)
    lines = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
    assert [cells[0][2:] for cells in lines] == ["`tree_random`", "`trace`", "`trace_prefix`", "`trace_root`",
                                                 "`trace`", "`trace`", "`trace`"]
    rows = {cells[0][2:]: cells for cells in lines[:4]}
    want = calibration_noise([pool_diagrams(audits["stages", "trace_root"][s]) for s in range(4)])["debiased"]
    assert rows["`trace_root`"][3].startswith(f"{want:.3f} [")
    reference = audits["exploration-base", "tree_random"]
    diff = debiased_ece_difference(audits["stages", "trace_root"], reference, resamples=1000)
    assert rows["`trace_root`"][4] == f"{diff['difference']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"
    assert diff["low"] > 0 and rows["`tree_random`"][4] == "reference"
    # the same arm of another report is its own row, paired with the reference on its own audits
    diff = debiased_ece_difference(audits["exploration-weighted", "trace"], reference, resamples=1000)
    assert lines[4][4] == f"{diff['difference']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"
    assert lines[4][4] != rows["`trace`"][4] and "explore_weight: balanced" in lines[4][1]
    assert "explore_weight: 4" in lines[5][1] and "labels: branch_point" in lines[6][1]
    assert "seeds 0-3 (those both reports hold)" in text and "no correction over the 12 differences" in text
    del stages_entries["trace_root"]["audit_diagrams"]
    (tmp_path / "reports" / "runs" / "stages" / "metrics.json").write_text(
        json.dumps({"ablations": stages_entries, "warmup": {}}))
    assert "has no per-audit diagrams of `trace_root`" in stages_table(ctx)


def test_the_power_table_judges_each_audit_against_the_bar_and_checks_each_dense_run_trained_alike(tmp_path,
                                                                                                  monkeypatch):
    from tests.test_reliability import _seed_audits
    from scripts import docs_tables_predictor as predictor_tables
    from trace.predictor.reliability import compact_rows, debiased_ece_difference

    rng = np.random.default_rng(5)
    monkeypatch.setattr(predictor_tables, "POWER_REPORTS", {"a": ("own", "sparse"), "a-dense": ("own", "dense"),
                                                            "b": ("other", "sparse"), "b-dense": ("other", "dense")})
    monkeypatch.setattr(predictor_tables, "POWER_TWINS", {"a-dense": "a", "b-dense": "b"})
    draws = {gap: [_seed_audits(rng, 4, gap) for _ in range(5)] for gap in (0.0, 0.08)}  # 40 audits a seed
    audits = {key: {s: [a for draw in draws[gap] for a in draw[s]] for s in range(4)}
              for key, gap in (("a-dense", 0.0), ("b-dense", 0.08))}

    def entry(key: str, debiased: dict, flips: float) -> dict:
        n = 40 if key.endswith("dense") else 8
        extra = 20.0 if key == "b-dense" else 0.0  # b-dense audits a few more: the cost is the mean of the runs
        seeds = {f"s{s}": flips + s for s in range(4)}
        runs = audits.get(key, {s: [[]] * n for s in range(4)})
        return {"pooled_ece": {"root": 0.05, "prefix": 0.06}, "pooled_ece_seeds": {"root": seeds, "prefix": seeds},
                "debiased_ece": {k: v[0] for k, v in debiased.items()}, "ece_floor": {"root": 0.01, "prefix": 0.02},
                "debiased_ece_interval": {k: {"low": v[1], "high": v[2]} for k, v in debiased.items()},
                "reliability": {"root": [{"count": 512.0 * n}], "prefix": [{"count": 1024.0 * n}]},
                "audit_diagrams": {k: {f"s{s}": [compact_rows(a) if a else [] for a in r] for s, r in runs.items()}
                                   for k in ("root", "prefix")},
                "audit": {}, "audit_seeds": {"audit/flips": seeds, "audit/mixed_groups": seeds,
                                             "truth/rollouts": {"s0": 100.0 * n, "s1": 100.0 * n + extra}},
                **{s: {"eval/accuracy/mean_at_8": 0.4, "eval/accuracy/greedy": 0.5} for s in seeds}}

    readings = {"a": {"root": (0.043, 0.028, 0.066), "prefix": (0.06, 0.052, 0.08)},
                "a-dense": {"root": (0.042, 0.033, 0.048), "prefix": (0.047, 0.039, 0.055)},
                "b": {"root": (0.05, 0.03, 0.07), "prefix": (0.04, 0.02, 0.07)},
                "b-dense": {"root": (0.052, 0.04, 0.06), "prefix": (0.058, 0.052, 0.066)}}
    index = {}
    for key, debiased in readings.items():
        folder = tmp_path / "reports" / "runs" / key
        folder.mkdir(parents=True)
        flips = 15.0 if key == "b" else 14.0  # b-dense trained otherwise than the run it audits again
        (folder / "metrics.json").write_text(json.dumps({"ablations": {"trace": entry(key, debiased, flips)},
                                                         "warmup": {}}))
        index[key] = key
    text = predictor_tables.power_table(docs_tables.Context(root=tmp_path, doc=tmp_path / "docs" / "r.md", index=index))
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| own", "| other"))]
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in rows[:4]] == [
        ("sparse", "root", "8", "4,096", "0.043 [0.028, 0.066]"),
        ("sparse", "prefix", "8", "8,192", "0.060 [0.052, 0.080]"),
        ("dense", "root", "40", "20,480", "0.042 [0.033, 0.048]"),
        ("dense", "prefix", "40", "40,960", "0.047 [0.039, 0.055]")]
    assert [r[-1].rstrip(" |") for r in rows] == [
        "at or below 0.05 at the point; above 0.066 excluded", "above 0.05: missed", "below 0.05: met",
        "at or below 0.05 at the point; above 0.055 excluded", "at or below 0.05 at the point; above 0.070 excluded",
        "at or below 0.05 at the point; above 0.070 excluded", "above 0.05 at the point; above 0.060 excluded",
        "above 0.05: missed"]
    assert "`a-dense` and `a` trained alike" in text
    assert "`b-dense` and `b` trained differently (`audit/flips`, `audit/mixed_groups` differ)" in text
    assert "a pair that trained differently does not score one predictor" in text and "so each pair" not in text
    assert "dense: 4,005 (mean over its runs)" in text and "sparse: 800" in text  # (4,000 + 4,010) / 2
    # the later dense run minus the first, paired by seed, as debiased_ece_difference gives it
    diff = debiased_ece_difference(audits["b-dense"], audits["a-dense"])
    assert diff["low"] > 0
    assert (f"`b-dense` minus `a-dense`, paired by seed: roots {diff['difference']:+.3f} [{diff['low']:+.3f}, "
            f"{diff['high']:+.3f}]") in text


def test_the_accounting_table_gives_each_arms_steps_and_tokens_per_seed(tmp_path):
    iv = lambda mean: {"mean": mean, "low": mean, "high": mean, "n": 2}  # noqa: E731
    ablations = {arm: {"mean": {"eval greedy": iv(0.5)},
                       **{f"s{s}": {"arm/steps": steps[s], "arm/tokens": tokens[s]} for s in range(2)}}
                 for arm, steps, tokens in (("grpo", [161, 161], [350_100.0, 350_900.0]),
                                            ("trace", [205, 209], [350_050.0, 350_400.0]))}
    folder = tmp_path / "reports" / "runs" / "tokens-x"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    ctx = docs_tables.Context(root=tmp_path, doc=tmp_path / "README.md", index={"tokens": "tokens-x"})
    text = docs_tables.tables()["tokens-accounting"](ctx)
    assert "| `grpo` | 161.0 | s0 161, s1 161 | 350,500 | s0 350,100, s1 350,900 |" in text
    assert "| `trace` | 207.0 | s0 205, s1 209 | 350,225 | s0 350,050, s1 350,400 |" in text
    ablations["trace"]["s1"].pop("arm/steps")  # a seed without its steps: the arm is left out, not half-counted
    (folder / "metrics.json").write_text(json.dumps({"ablations": ablations, "warmup": {}}))
    assert "`trace`" not in docs_tables.tables()["tokens-accounting"](ctx)
