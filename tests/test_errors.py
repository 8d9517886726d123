"""Expected errors end a command with one message and exit status 1; the traceback only under TRACE_DEBUG."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import check_params as check_params_cli
from flows import pipeline as pipeline_cli
from trace.training.checkpoint import CheckpointError
from trace.configuration.config import ConfigError
from trace.data_paths import DataError
from trace.envs.retrieval import RetrieverError
from trace.errors import DEBUG_ENV, UserError, quiet_orchestrator_tracebacks, user_errors
from trace.prepared import PreparedFileError
from trace.tree import RewardError
from trace.tree_io import TreeFileError

REPO = Path(__file__).resolve().parents[1]


def test_every_expected_error_of_the_stages_is_a_user_error_and_keeps_its_builtin_base():
    for error, builtin in [(ConfigError, ValueError), (DataError, ValueError), (PreparedFileError, ValueError),
                           (TreeFileError, ValueError), (RewardError, ValueError), (CheckpointError, RuntimeError),
                           (RetrieverError, RuntimeError)]:
        assert issubclass(error, UserError) and issubclass(error, builtin), error


def test_a_user_error_prints_its_message_alone_and_exits_1(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        with user_errors():
            raise DataError("data/x.jsonl line 3: missing answer; fix the row")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "error: data/x.jsonl line 3: missing answer; fix the row"
    assert "Traceback" not in err and DEBUG_ENV in err


def test_trace_debug_shows_the_traceback_and_other_errors_always_keep_theirs(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(DataError):
        with user_errors():
            raise DataError("bad")
    monkeypatch.delenv(DEBUG_ENV)
    with pytest.raises(KeyError):  # a bug, not a user error
        with user_errors():
            raise KeyError("bug")


def test_the_orchestrators_traceback_of_a_user_error_is_dropped_and_any_other_kept(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    quiet_orchestrator_tracebacks()
    logger = logging.getLogger("prefect.flow_runs")

    def passes(exc):
        try:
            raise exc
        except Exception:
            record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Encountered exception", (),
                                       sys.exc_info())
        return all(f.filter(record) for f in logger.filters)

    assert not passes(ConfigError("bad key"))
    assert passes(RuntimeError("bug"))
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert passes(ConfigError("bad key"))


@pytest.mark.parametrize("override, message", [
    ("train.seeds=[0,1", r"override 'train.seeds=\[0,1': the value '\[0,1' is not valid YAML"),
    ("seed.x=1", r"override 'seed.x': seed is a value \(0 in .*params.yaml\), not a section"),
    ("train.num_steps", r"override 'train.num_steps' must be KEY=VALUE"),
])
@pytest.mark.parametrize("cli", ["check_params", "pipeline"])
def test_a_bad_override_on_the_command_line_is_one_message_and_exit_1(capsys, monkeypatch, cli, override, message):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        if cli == "check_params":
            check_params_cli.main(["-S", override])
        else:
            pipeline_cli.main(["run", "-S", override])
    code, err = exit_info.value.code, capsys.readouterr().err
    text = err if code == 1 else str(code)  # check_params prints and exits 1; pipeline exits with the message
    assert code == 1 or isinstance(code, str)
    assert "Traceback" not in text
    import re

    assert re.search(message, text), text


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.fixture(scope="module")
def deepspeed_ready():
    from trace.update import init_distributed_env

    init_distributed_env()


def _real_checkpoint(tmp_path):
    """A checkpoint written by the real updater and predictor of a tiny policy."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trace.training.checkpoint import write_checkpoint
    from trace.configuration.config import UpdateConfig
    from trace.update import PolicyUpdater

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))

    class Predictor:
        def save(self, path):
            torch.save({"w": torch.ones(2)}, path)

        def load_state_dict(self, state):
            self.state = state

    def updater():
        return PolicyUpdater(model, UpdateConfig(), pad_token_id=0)

    write_checkpoint(tmp_path, 3, updater=updater(), predictor=Predictor(), params_hash="h", ablation="grpo",
                     cumulative_tokens=1.0, cumulative_trajectories=1.0, history=[])
    return updater, Predictor


@pytest.mark.parametrize("damaged", ["deepspeed", "predictor", "state"])
def test_a_truncated_checkpoint_names_its_file_and_the_fix(tmp_path, deepspeed_ready, damaged):
    from trace.training.checkpoint import CHECKPOINT_DIR, PREDICTOR_FILE, STATE_FILE, load_checkpoint

    updater, predictor = _real_checkpoint(tmp_path)
    ckpt = tmp_path / CHECKPOINT_DIR
    target = {"deepspeed": next((ckpt / "step000003").rglob("*model_states.pt")),
              "predictor": ckpt / f"{PREDICTOR_FILE}.step000003", "state": ckpt / STATE_FILE}[damaged]
    _truncate(target)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, updater=updater(), predictor=predictor(), params_hash="h", ablation="grpo")
    message = str(err.value)
    assert "training checkpoint" in message and "cannot be read" in message
    assert f"rm -r {ckpt}" in message
    assert (str(target) if damaged != "deepspeed" else str(ckpt / "step000003")) in message


def test_the_intact_real_checkpoint_loads(tmp_path, deepspeed_ready):
    from trace.training.checkpoint import load_checkpoint

    updater, predictor = _real_checkpoint(tmp_path)
    state = load_checkpoint(tmp_path, updater=updater(), predictor=predictor(), params_hash="h", ablation="grpo")
    assert state["next_step"] == 3


@pytest.mark.slow
def test_a_stage_on_a_file_of_bad_rows_exits_1_with_one_message_and_no_traceback(tmp_path):
    """``python -m flows.prepare`` on a preset whose train file has only bad rows: the real stage, Prefect
    flow run included; with TRACE_DEBUG=1 the same run shows the traceback."""
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"question": "Who?"}) + "\nnot json\n")
    params = yaml.safe_load((REPO / "params" / "hotpotqa.yaml").read_text())
    params["task"]["files"].update({"train_path": str(rows), "format": "qa_pairs", "eval_path": None})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "TRACE_DATA_DIRS": str(tmp_path), "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop(DEBUG_ENV, None)
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "flows.prepare", "--params", str(tmp_path / "params.yaml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert (f"error: task 'hotpotqa': the train split of {rows} has no usable prompt: 0 rows parsed, 2 bad rows "
            "skipped") in out.stderr
