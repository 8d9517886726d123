"""Which training prompts the seed rollouts sample."""

import numpy as np
import pytest

from trace.training.seed_rollouts import choose_seed_prompts
from trace.training.seeding import step_seed


def test_seed_prompts_are_a_seeded_draw_without_replacement_in_pool_order():
    pool = [f"p{i}" for i in range(50)]
    chosen = choose_seed_prompts(pool, 12, seed=3)
    # the obvious version: one draw of 12 distinct positions from the (seed, -1, "seed_prompts") stream, sorted
    rng = np.random.default_rng(step_seed(3, -1, "seed_prompts"))
    expected = [pool[i] for i in sorted(rng.choice(50, size=12, replace=False))]
    assert chosen == expected
    assert len(set(chosen)) == 12 and chosen == sorted(chosen, key=pool.index)


def test_seed_prompts_depend_on_the_seed():
    pool = list(range(100))
    assert choose_seed_prompts(pool, 10, seed=0) != choose_seed_prompts(pool, 10, seed=1)


@pytest.mark.parametrize("num_prompts", [8, 9, 100])
def test_asking_for_the_whole_pool_or_more_takes_every_prompt_once(num_prompts):
    pool = list(range(8))
    assert choose_seed_prompts(pool, num_prompts, seed=0) == pool
