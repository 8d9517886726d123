"""``train.prompt_pool``: RL steps draw candidates from the first N training prompts, so prompts recur."""

import pytest

from trace.configuration.params_file import ConfigError, load_config
from trace.prepared import rl_prompt_pool
from trace.training.seeding import candidate_indices


def test_the_pool_is_the_first_prompts_and_none_is_all():
    prompts = [f"p{i}" for i in range(100)]
    assert rl_prompt_pool(prompts, None) == prompts
    assert rl_prompt_pool(prompts, 40) == prompts[:40]
    with pytest.raises(ValueError, match="train.prompt_pool=101 exceeds the 100 prepared training prompts"):
        rl_prompt_pool(prompts, 101)


def test_a_pool_of_p_prompts_recurs_every_p_over_b_steps():
    pool, b = 64, 32  # two steps an epoch
    seen = [set(candidate_indices(pool, b, 0, step)) for step in range(8)]
    for epoch in range(4):  # each epoch draws every prompt of the pool once
        assert seen[2 * epoch] | seen[2 * epoch + 1] == set(range(pool))
    # the study's shape: 1,000 prompts, 32 a step, 160 steps (5.12 epochs; steps straddle epoch boundaries)
    prompts = rl_prompt_pool([f"p{i}" for i in range(8000)], 1000)
    drawn = [prompts[i] for step in range(160) for i in candidate_indices(len(prompts), 32, 0, step)]
    counts = {p: drawn.count(p) for p in set(drawn)}
    assert set(counts) == set(prompts) and set(counts.values()) == {5, 6}  # every prompt 5 or 6 times, none outside


def test_the_params_check_the_pool_and_keep_the_hash_unset():
    from trace.configuration.config import config_from_dict

    # these params' hash from before the key existed (tests/test_config.py pins it too)
    assert config_from_dict({"policy": {"dtype": "float32"}, "update": {"bf16": False}}).params_hash() == "1d1ea06a8418"
    default = load_config("params.yaml")
    assert default.train.prompt_pool is None
    assert load_config("params.yaml", {"train.prompt_pool": None}).params_hash() == default.params_hash()
    assert load_config("params.yaml", {"train.prompt_pool": 1000}).params_hash() != default.params_hash()
    with pytest.raises(ConfigError, match="train.prompt_pool=9000 exceeds task.kgqa.num_train=8000"):
        load_config("params.yaml", {"train.prompt_pool": 9000})
    with pytest.raises(ConfigError, match="allocation.num_candidates=32 exceeds train.prompt_pool=16"):
        load_config("params.yaml", {"train.prompt_pool": 16})
    with pytest.raises(ConfigError, match="train.probe_prompts=256 exceeds train.prompt_pool=200"):
        load_config("params.yaml", {"train.prompt_pool": 200, "train.probe_prompts": 256})
