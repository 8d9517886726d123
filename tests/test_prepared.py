import pytest

from trace.envs.base import Prompt
from trace.prepared import PreparedFileError, read_prompts, save_prompts


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
