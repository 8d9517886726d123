"""Training checkpoints: the state file names a complete tag, older tags go, other params are never loaded."""

import json

import torch

from trace.training.checkpoint import CHECKPOINT_DIR, PREDICTOR_FILE, STATE_FILE, load_checkpoint, state_path, write_checkpoint


class RecordingUpdater:
    """Writes one file per DeepSpeed tag, as the engine's folder layout does, and records loads."""

    def __init__(self):
        self.loaded_tags = []

    def save_checkpoint(self, folder, tag):
        (folder / tag).mkdir(parents=True, exist_ok=True)
        (folder / tag / "model_states.pt").write_bytes(tag.encode())

    def load_checkpoint(self, folder, tag):
        assert (folder / tag).is_dir()
        self.loaded_tags.append(tag)


class DictPredictor:
    def __init__(self, value=0.0):
        self.state = {"value": value}

    def save(self, path):
        torch.save(self.state, path)

    def load_state_dict(self, state):
        self.state = dict(state)


def _write(run_dir, step_done, value=0.0, params_hash="h", ablation="trace"):
    write_checkpoint(run_dir, step_done, updater=RecordingUpdater(), predictor=DictPredictor(value),
                     params_hash=params_hash, ablation=ablation, cumulative_tokens=10.0 * step_done,
                     cumulative_trajectories=2.0 * step_done,
                     history=[{"step": s, "reward/mean": 0.5} for s in range(step_done)])


def test_state_file_holds_the_counters_in_the_order_resume_reads_them(tmp_path):
    _write(tmp_path, 2)
    assert state_path(tmp_path) == tmp_path / CHECKPOINT_DIR / STATE_FILE
    state = json.loads(state_path(tmp_path).read_text())
    assert list(state) == ["next_step", "tag", "params_hash", "ablation", "cumulative_tokens",
                           "cumulative_trajectories", "world_size", "zero_stage", "history", "allocator_state"]
    assert state["tag"] == "step000002" and state["next_step"] == 2 and len(state["history"]) == 2
    assert state["allocator_state"] is None  # the arm's root rule keeps no state
    # what a resume at another world size needs to know: whose shards these are
    assert state["world_size"] == 1 and state["zero_stage"] == 0


def test_the_allocators_state_is_written_with_the_counters_and_read_back_as_it_was(tmp_path):
    from trace.allocation.mopps import MoppsState

    posterior = MoppsState()
    posterior.observe(["kgqa/q1", "kgqa/q2"], [[1.0, 0.0, 1.0], [0.0, 0.0]])
    write_checkpoint(tmp_path, 3, updater=RecordingUpdater(), predictor=DictPredictor(), params_hash="h",
                     ablation="mopps", cumulative_tokens=0.0, cumulative_trajectories=0.0, history=[],
                     allocator_state=posterior.state_dict())
    state = load_checkpoint(tmp_path, updater=RecordingUpdater(), predictor=DictPredictor(), params_hash="h",
                            ablation="mopps")
    restored = MoppsState()
    restored.load_state_dict(state["allocator_state"])
    assert restored.state_dict() == posterior.state_dict() == {"alpha": {"kgqa/q1": 3.0, "kgqa/q2": 1.0},
                                                               "beta": {"kgqa/q1": 2.0, "kgqa/q2": 3.0}}


def test_a_new_checkpoint_removes_the_older_tags_and_predictor_files(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    ckpt = tmp_path / CHECKPOINT_DIR
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([STATE_FILE, "step000004", f"{PREDICTOR_FILE}.step000004"])


def test_load_restores_the_newest_tag_into_updater_and_predictor(tmp_path):
    _write(tmp_path, 2, value=1.0)
    _write(tmp_path, 4, value=2.0)
    updater, predictor = RecordingUpdater(), DictPredictor()
    state = load_checkpoint(tmp_path, updater=updater, predictor=predictor, params_hash="h", ablation="trace")
    assert state["next_step"] == 4 and state["cumulative_tokens"] == 40.0
    assert updater.loaded_tags == ["step000004"] and predictor.state == {"value": 2.0}


def test_a_checkpoint_of_other_params_or_another_arm_is_discarded_with_its_run_folder(tmp_path):
    for params_hash, ablation in (("other", "trace"), ("h", "grpo")):
        run_dir = tmp_path / f"{params_hash}-{ablation}"
        _write(run_dir, 2)
        (run_dir / "trees").mkdir()
        updater, predictor = RecordingUpdater(), DictPredictor(7.0)
        assert load_checkpoint(run_dir, updater=updater, predictor=predictor, params_hash=params_hash,
                               ablation=ablation) is None
        assert not run_dir.exists() and updater.loaded_tags == [] and predictor.state == {"value": 7.0}


def test_no_checkpoint_loads_nothing(tmp_path):
    updater = RecordingUpdater()
    assert load_checkpoint(tmp_path, updater=updater, predictor=DictPredictor(), params_hash="h",
                           ablation="trace") is None
    assert updater.loaded_tags == [] and tmp_path.exists()


def test_a_zero_checkpoint_of_another_world_size_is_converted_to_a_universal_one_before_loading(tmp_path,
                                                                                                 monkeypatch):
    import trace.update

    _write(tmp_path, 2)
    state = json.loads(state_path(tmp_path).read_text())
    state.update(world_size=2, zero_stage=2)  # written by 2 ranks under ZeRO-2; this process is 1 rank
    state_path(tmp_path).write_text(json.dumps(state))
    converted = []

    def convert(folder, tag, out_tag):
        converted.append((tag, out_tag))
        (folder / out_tag).mkdir()

    class UniversalUpdater(RecordingUpdater):
        def load_checkpoint(self, folder, tag, universal=False):
            assert (folder / tag).is_dir()
            self.loaded_tags.append((tag, universal))

    monkeypatch.setattr(trace.update, "convert_to_universal_checkpoint", convert)
    updater = UniversalUpdater()
    load_checkpoint(tmp_path, updater=updater, predictor=DictPredictor(), params_hash="h", ablation="trace")
    assert converted == [("step000002", "step000002_universal.partial")]
    assert updater.loaded_tags == [("step000002_universal", True)]
    # a second resume reuses the finished conversion
    load_checkpoint(tmp_path, updater=updater, predictor=DictPredictor(), params_hash="h", ablation="trace")
    assert len(converted) == 1
    state.update(zero_stage=0)  # stage 0 holds the whole optimizer state: loads into any world size as it is
    state_path(tmp_path).write_text(json.dumps(state))
    load_checkpoint(tmp_path, updater=updater, predictor=DictPredictor(), params_hash="h", ablation="trace")
    assert updater.loaded_tags[-1] == ("step000002", False)
