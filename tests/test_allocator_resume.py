"""A stateful allocator (mopps) through the training loop: its state rides in the checkpoint, and a resumed run
allocates and trains exactly as an uninterrupted one."""

import json

import pytest

from tests.test_loop import end_episodes_at_the_first_turn, tiny_trainer
from trace.training.checkpoint import CheckpointError, state_path
from trace.tree_io import read_trees, tree_path

pytestmark = pytest.mark.slow

SETTINGS = {"train.num_steps": 4, "train.checkpoint_every": 2, "update.lr": 0.05,
            # a small pool: candidates recur within 4 steps, so the posterior of a prompt seen before decides
            "task.kgqa.num_train": 12, "allocation.num_candidates": 6}


@pytest.fixture
def checksum_rewards(monkeypatch):
    """Mixed groups from the untrained tiny policy, so the posteriors move (``end_episodes_at_the_first_turn``)."""
    end_episodes_at_the_first_turn(monkeypatch)


def _trees(trainer, steps):
    return [[(t.prompt_uid, [n.token_ids for n in t.nodes], t.leaf_rewards().tolist())
             for t in read_trees(tree_path(trainer.trees_root, "mopps", s))] for s in steps]


def test_a_resumed_mopps_run_allocates_and_trains_as_an_uninterrupted_one(tmp_path, checksum_rewards):
    full = tiny_trainer("mopps", tmp_path / "full", SETTINGS)
    full.run()
    first = tiny_trainer("mopps", tmp_path / "part", {**SETTINGS, "train.num_steps": 2})
    first.run()
    saved = json.loads(state_path(tmp_path / "part").read_text())["allocator_state"]
    assert saved == json.loads(json.dumps(first.allocator_state.state_dict())) and saved["alpha"]

    resumed = tiny_trainer("mopps", tmp_path / "part", SETTINGS)
    assert resumed.allocator_state.state_dict() == {"alpha": {}, "beta": {}}  # fresh until the checkpoint loads
    assert resumed.resume() == 2
    assert resumed.allocator_state.state_dict() == first.allocator_state.state_dict()
    resumed.run()
    assert _trees(resumed, range(4)) == _trees(full, range(4))
    assert resumed.allocator_state.state_dict() == full.allocator_state.state_dict()
    # every step's metrics but times and the evaluation the 2-step run made at its end (NaN equal to NaN)
    skip = ("time/", "accuracy/eval", "probe/")
    a, b = (json.dumps([{k: v for k, v in h.items() if not k.startswith(skip) and "seconds" not in k}
                        for h in t.history], sort_keys=True) for t in (resumed, full))
    assert a == b


def test_a_checkpoint_without_the_allocators_state_is_refused_with_the_fix(tmp_path, checksum_rewards):
    tiny_trainer("mopps", tmp_path / "run", {**SETTINGS, "train.num_steps": 2}).run()
    path = state_path(tmp_path / "run")
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "allocator_state": None}))  # e.g. written before the arm kept state
    with pytest.raises(CheckpointError, match=r"holds no allocator state for the arm 'mopps'.*rm -r"):
        tiny_trainer("mopps", tmp_path / "run", SETTINGS).resume()


@pytest.mark.parametrize("damage, message", [
    (lambda s: {"alpha": s["alpha"]}, r"lacks the key 'beta'"),  # a state cut short
    (lambda s: {"alpha": list(s["alpha"]), "beta": s["beta"]}, r"does not hold the arm's fields"),
])
def test_an_allocator_state_missing_a_key_is_refused_naming_the_file_and_the_fix(tmp_path, checksum_rewards,
                                                                                  damage, message):
    tiny_trainer("mopps", tmp_path / "run", {**SETTINGS, "train.num_steps": 2}).run()
    path = state_path(tmp_path / "run")
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "allocator_state": damage(state["allocator_state"])}))
    with pytest.raises(CheckpointError, match=message) as caught:
        tiny_trainer("mopps", tmp_path / "run", SETTINGS).resume()
    assert str(path) in str(caught.value) and f"rm -r {tmp_path / 'run' / 'checkpoint'}" in str(caught.value)
