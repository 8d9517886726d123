"""Equal tokens: train.token_budget stops each arm within one step of the budget, evaluations fall at the same
token marks for every arm, and a resumed run stops where an uninterrupted one does."""

from __future__ import annotations

import pytest

from trace.configuration.config import ConfigError
from trace.training.token_budget import budget_spent, crossed_marks
from tests.test_loop import tiny_trainer


def test_marks_are_the_multiples_below_the_budget_and_the_budget():
    assert crossed_marks(250, 320, 300, 1000) == [300]
    assert crossed_marks(300, 599, 300, 1000) == []  # a mark counts once: the step that reached it
    assert crossed_marks(290, 650, 300, 1000) == [300, 600]
    assert crossed_marks(950, 1100, 300, 1000) == [1000]
    assert crossed_marks(0, 5000, None, 1000) == [1000]  # without eval_every_tokens the budget alone
    assert crossed_marks(0, 5000, 300, None) == []
    with pytest.raises(ValueError, match="went down"):
        crossed_marks(10, 5, 3, 100)
    assert budget_spent(1000, 1000) and not budget_spent(999, 1000) and not budget_spent(10**9, None)


def test_marks_without_a_budget_are_refused_and_unset_keys_leave_the_hash_alone():
    from trace.configuration.params_file import load_config

    with pytest.raises(ConfigError, match="train.eval_every_tokens=100 needs train.token_budget"):
        load_config("params.yaml", {"train.eval_every_tokens": 100})
    base = load_config("params.yaml")
    budget = load_config("params.yaml", {"train.token_budget": 5000})
    assert budget.params_hash() != base.params_hash()
    # a run at equal steps (or at another budget) may have trained past this budget: never resumed as this one
    assert budget.resume_hash() != base.resume_hash()
    assert budget.resume_hash() != load_config("params.yaml", {"train.token_budget": 6000}).resume_hash()
    assert budget.resume_hash() == load_config("params.yaml", {"train.token_budget": 5000,
                                                               "train.num_steps": 99}).resume_hash()


@pytest.mark.slow
def test_the_budget_stops_each_arm_within_one_step_at_the_same_marks_and_resumes_alike(tmp_path):
    free = tiny_trainer("grpo", tmp_path / "free", {"train.num_steps": 4})
    free.run()
    cumulative = [h["tokens/cumulative"] for h in free.history]
    budget = int(cumulative[1]) + 1  # reached in the third step
    every = max(1, budget // 3)
    overrides = {"train.num_steps": 20, "train.token_budget": budget, "train.eval_every_tokens": every,
                 "train.checkpoint_every": 1}
    marks = {}
    for arm in ("grpo", "trace"):
        trainer = tiny_trainer(arm, tmp_path / arm, overrides)
        trainer.run()
        tokens = [h["tokens/cumulative"] for h in trainer.history]
        # stopped at the first step that reached the budget: within one step of it
        assert tokens[-1] >= budget > (tokens[-2] if len(tokens) > 1 else 0.0)
        assert trainer.budget_spent and len(trainer.history) < 20
        # every evaluation is at a crossed mark, and every mark crossed was evaluated
        evals = [h for h in trainer.history if "accuracy/eval" in h]
        assert all("eval/token_mark" in h for h in evals) and len(evals) == sum("eval/token_mark" in h
                                                                                for h in trainer.history)
        marks[arm] = [h["eval/token_mark"] for h in trainer.history if "eval/token_mark" in h]
        assert trainer.run() == []  # spent: nothing more runs
    expected = [float(m) for m in range(every, budget, every)] + [float(budget)]
    # one step may cross two marks (it evaluates once, at the last); the budget is always a mark
    assert marks["grpo"][-1] == marks["trace"][-1] == float(budget)
    assert set(marks["grpo"]) <= set(expected) and set(marks["trace"]) <= set(expected)

    # killed after two steps and resumed: the same steps, the same stop and tokens as uninterrupted
    first = tiny_trainer("trace", tmp_path / "resumed", overrides)
    first.run(until_step=2)
    second = tiny_trainer("trace", tmp_path / "resumed", overrides)
    assert second.resume() == 2
    second.run()
    uninterrupted = tiny_trainer("trace", tmp_path / "trace", overrides)
    uninterrupted.resume()
    assert second.next_step == uninterrupted.next_step
    assert second.cumulative_tokens == uninterrupted.cumulative_tokens
