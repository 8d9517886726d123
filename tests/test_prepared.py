import pytest

from trace.envs.base import Prompt
from trace.prepared import PreparedFileError, check_unique_prompt_uids, read_prompts, save_prompts


def test_prompts_round_trip(tmp_path):
    prompts = [Prompt("kgqa", "train-1", "question : r1 of e3 ?", "e7", {"num_hops": 1}),
               Prompt("hotpotqa", "1", "Who?", ["A", "a"], {})]
    path = save_prompts(prompts, tmp_path / "p.jsonl")
    assert read_prompts(path) == prompts


def test_duplicate_prompt_uid_is_refused(tmp_path):
    p = Prompt("kgqa", "1", "q")
    with pytest.raises(ValueError, match="duplicate prompt_uid 'kgqa/1'"):
        save_prompts([p, p], tmp_path / "p.jsonl")
    assert not (tmp_path / "p.jsonl").exists()


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"data_source": "kgqa", "example_id": "1", "question": "q"}\n{not json\n')
    with pytest.raises(PreparedFileError, match=r"p.jsonl:2"):
        read_prompts(path)
    with pytest.raises(PreparedFileError, match="run the prepare stage"):
        read_prompts(tmp_path / "missing.jsonl")


def test_a_prompt_uid_shared_by_two_splits_fails_naming_it_and_both_places():
    train = [Prompt("gsm8k", "0", "Train question?", "1"), Prompt("gsm8k", "1", "Other?", "2")]
    evaluation = [Prompt("gsm8k", "0", "Eval question?", "3")]
    with pytest.raises(PreparedFileError, match=r"'gsm8k/0' is shared by train prompt 0 and eval prompt 0"):
        check_unique_prompt_uids({"train": train, "eval": evaluation})
    check_unique_prompt_uids({"train": train, "eval": [Prompt("gsm8k", "eval:0", "Eval question?", "3")]})


def test_reading_a_file_that_repeats_a_prompt_uid_names_both_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    line = '{"data_source": "gsm8k", "example_id": "0", "question": "q"}\n'
    path.write_text(line + '{"data_source": "gsm8k", "example_id": "1", "question": "q"}\n' + line)
    with pytest.raises(PreparedFileError, match=r"p.jsonl:3: prompt_uid 'gsm8k/0' already on line 1"):
        read_prompts(path)
