import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace.configuration.config import DataFileConfig, TaskConfig, TaskName
from trace.data_paths import DataError, resolve_data_path
from trace.data.splits import load_prompts, load_split
from trace.envs.fc import FunctionCallingEnvironment
from trace.envs.math import MathEnvironment
from trace.envs.qa import QAEnvironment
from trace.envs.registry import make_environment
from trace.envs.retrieval import ContextBM25Retriever, CorpusBM25Retriever

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"offline data folder {SHARED_DATA} not present")


def task(name: TaskName, **files) -> TaskConfig:
    return TaskConfig(name=name, files=DataFileConfig(**files))


def first(name: TaskName, path: str, **files):
    """The first prompt of ``path`` (under ../shared/data) loaded as the train split of ``name``."""
    result = load_split(task(name, train_path=f"../shared/data/{path}", eval_fraction=0.0, **files), "train")
    assert result.bad_rows == ()
    return result.prompts[0], result


# ---- one real row per loader ------------------------------------------------------------------------------

@needs_data
def test_hotpotqa_hugging_face_format():
    prompt, result = first(TaskName.HOTPOTQA, "hotpotqa/rpt_hf_distractor_validation/dev.jsonl")
    assert result.formats == ("hotpot_hf",) and len(result.prompts) == 300
    assert prompt.prompt_uid == "hotpotqa/5a8ce55f554299441c6b9f62"
    assert prompt.question == ('The band who released the debut album "Tinted Windows" had their first performance '
                               "in what city?")
    assert prompt.answer == ["Tulsa"] and prompt.meta["type"] == "bridge"
    titles = [t for t, _ in prompt.meta["context"]]
    assert len(titles) == 10 and titles[-1] == "Tinted Windows (band)"
    assert prompt.meta["context"][0][1].startswith("Act of Congress is a Birmingham, Alabama based singer-songwriter "
                                                   "group. They play only acoustic instruments")


@needs_data
def test_hotpotqa_original_format():
    prompt, result = first(TaskName.HOTPOTQA, "hotpotqa/hipporag_original_format/hotpotqa_train.json")
    assert result.formats == ("hotpot_original",) and len(result.prompts) == 100
    assert prompt.example_id == "5a77ec115542992a6e59dff7"
    assert (prompt.question, prompt.answer) == ("If Gallu is a demon Lilu is what?", ["a spirit"])
    assert prompt.meta["context"][0][0] == "Demon Dice" and len(prompt.meta["context"]) == 10


@needs_data
def test_musique_with_paragraphs_and_aliases():
    prompt, result = first(TaskName.MUSIQUE, "musique/hipporag_original_format/musique_train.json")
    assert result.formats == ("musique",) and len(result.prompts) == 100
    assert prompt.example_id == "2hop__150763_14904" and prompt.meta["hops"] == 2
    assert prompt.answer == ["G. Stanley Hall", "Stanley Hall"] and len(prompt.meta["context"]) == 20
    dev, _ = first(TaskName.MUSIQUE, "musique/dev_qa_only/musique_test_questions_and_answers.json")
    assert (dev.example_id, dev.question, dev.answer) == ("0", "Who is the spouse of the Green performer?",
                                                          ["Miquette Giraudy"])


@needs_data
def test_2wikimultihopqa_bamboogle_and_nq_question_files():
    wiki, result = first(TaskName.TWOWIKI, "2wikimultihopqa/dev_qa_only/dev.json")
    assert len(result.prompts) == 1000 and result.formats == ("qa_pairs",)
    assert (wiki.example_id, wiki.answer) == ("0", ["Małgorzata Braunek"])  # test_id 0
    assert result.prompts[1].answer == ["Mask of Fu Manchu", "The Mask of Fu Manchu"]
    assert result.prompts[2].answer == ["12 June 1516"]  # a plain-string answer
    bamboogle, result = first(TaskName.BAMBOOGLE, "bamboogle/bamboogle_test_questions_and_answers.json")
    assert len(result.prompts) == 125 and bamboogle.answer == ["james madison"]
    result = load_split(task(TaskName.NQ, train_path="../shared/data/nq/nq_test_questions_and_answers.json",
                             eval_fraction=0.0), "train")
    nq = result.prompts[0]
    assert len(result.prompts) == 3608 and nq.question == "when was the last time anyone was on the moon"
    assert nq.answer == ["14 December 1972 UTC", "December 1972"]
    # the two rows whose only answers, ")" and "---", normalise to "" cannot be scored by exact match
    assert [bad.row for bad in result.bad_rows] == ["item 290", "item 363"]
    assert all("empty after answer normalisation" in bad.reason for bad in result.bad_rows)


@needs_data
def test_gsm8k_and_competition_math_files():
    gsm, result = first(TaskName.GSM8K, "gsm8k/train_first1000.jsonl")
    assert len(result.prompts) == 1000 and result.formats == ("gsm8k",)
    assert gsm.question.startswith("Natalia sold clips to 48 of her friends") and gsm.answer == "72"
    assert gsm.meta["calculations"] == ["48/2", "48+24"]
    aime, result = first(TaskName.AIME_AMC, "aime_amc/aime.json")
    assert len(result.prompts) == 30 and result.formats == ("math",)
    assert aime.answer == "204" and aime.meta["year"] == 2024 and aime.question.startswith("Every morning Aya")
    amc, _ = first(TaskName.AIME_AMC, "aime_amc/amc.json")
    assert amc.answer == "142"  # 142.0 in the file
    train, result = first(TaskName.AIME_AMC, "aime_amc/train_aime.json")
    assert len(result.prompts) == 975 and train.answer == "60"


def test_math_format_reads_the_answer_from_the_boxed_solution(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"problem": "What is $1/2 + 1/4$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1",
             "type": "Prealgebra"},
            {"problem": "Find $x$.", "solution": "x is $\\boxed{5}$.", "answer": "5",
             "unique_id": "test/algebra/1.json"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(task(TaskName.MATH, train_path=str(path), eval_fraction=0.0), "train",
                           allowed_roots=[tmp_path])
    assert [(p.example_id, p.answer) for p in prompts] == [("0", "\\frac{3}{4}"), ("test/algebra/1.json", "5")]
    assert prompts[0].meta == {"level": "Level 1", "type": "Prealgebra"}


@needs_data
def test_bfcl_question_file_with_its_possible_answers():
    prompt, result = first(TaskName.BFCL, "bfcl/BFCL_v4_simple_python.json")
    assert len(result.prompts) == 400
    assert prompt.example_id == "simple_python_0" and prompt.meta["category"] == "simple_python"
    assert prompt.question == "Find the area of a triangle with a base of 10 units and height of 5 units."
    assert prompt.answer == [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    assert prompt.meta["functions"][0]["name"] == "calculate_triangle_area"
    folder = load_split(task(TaskName.BFCL, eval_fraction=0.0), "train")  # default: the whole folder
    counts = {}
    for p in folder.prompts:
        counts[p.meta["category"]] = counts.get(p.meta["category"], 0) + 1
    assert counts == {"irrelevance": 240, "live_parallel": 16, "live_parallel_multiple": 24, "live_relevance": 16,
                      "multiple": 200, "parallel": 200, "parallel_multiple": 200, "simple_python": 400}
    irrelevance = next(p for p in folder.prompts if p.example_id == "irrelevance_0")
    assert irrelevance.answer == []


@needs_data
def test_a_spread_subset_of_a_folder_samples_every_file_and_a_first_subset_only_the_first():
    first_n = load_prompts(task(TaskName.BFCL, max_train=200, max_eval=50), "train")
    assert {p.meta["category"] for p in first_n} == {"irrelevance"}  # BFCL's folder, read file by file
    whole = load_prompts(task(TaskName.BFCL), "train")
    spread = load_prompts(task(TaskName.BFCL, max_train=200, subset="spread"), "train")
    assert len(spread) == 200 and {p.prompt_uid for p in spread} <= {p.prompt_uid for p in whole}
    assert len({p.meta["category"] for p in spread}) >= 5
    order = {p.prompt_uid: i for i, p in enumerate(whole)}
    assert [order[p.prompt_uid] for p in spread] == sorted(order[p.prompt_uid] for p in spread)  # file order
    evals = load_prompts(task(TaskName.BFCL, max_eval=50, subset="spread"), "eval")
    assert len(evals) == 50 and not {p.prompt_uid for p in evals} & {p.prompt_uid for p in whole}
    # the sample is chosen by each prompt's own id: a smaller cap keeps a subset of a larger one
    smaller = load_prompts(task(TaskName.BFCL, max_train=50, subset="spread"), "train")
    assert {p.prompt_uid for p in smaller} < {p.prompt_uid for p in spread}


@needs_data
def test_bfcl_without_an_answer_file_is_refused(tmp_path):
    question_file = tmp_path / "BFCL_v4_simple_python.json"
    question_file.write_text((SHARED_DATA / "bfcl" / "BFCL_v4_simple_python.json").read_text().splitlines()[0] + "\n")
    with pytest.raises(DataError, match="possible_answer"):
        load_prompts(task(TaskName.BFCL, train_path=str(question_file)), "train", allowed_roots=[tmp_path])


@needs_data
def test_api_bank_dialogues_and_test_file():
    prompt, result = first(TaskName.API_BANK, "api_bank/lv1-lv2-samples/level-1-given-desc",
                           corpus_path="../shared/data/api_bank/test-data/level-1-api.json")
    assert result.formats == ("api_bank_dialogues",) and len(result.prompts) == 389
    assert prompt.example_id == "AddAgenda-AddAlarm-GetUserToken-level-2-1:0"
    assert prompt.answer == [{"GetUserToken": {"username": "JaneSmith", "password": "password"}}]
    assert [f["name"] for f in prompt.meta["functions"]] == ["GetUserToken", "AddAgenda", "AddAlarm"]
    assert prompt.meta["functions"][0]["description"].startswith("Get the user token")
    test, result = first(TaskName.API_BANK, "api_bank/test-data/level-1-api.json")
    assert result.formats == ("api_bank_test",)
    assert test.example_id == "ModifyRegistration-QueryHealthData-CancelRegistration-level-2-2:0"
    assert test.question.startswith("The current year is 2023.\nUser: Can you please modify")
    assert test.answer == [{"ModifyRegistration": {"appointment_id": "34567890", "new_appointment_date": "2023-03-26",
                                                   "new_appointment_doctor": "Dr. Lee"}}]
    assert not test.question.endswith("Generate API Request:")
    assert len(result.prompts) == 399
    # API-Bank writes list values inside unescaped quotes (attendees='['John Smith', ...]'); they stay strings
    meeting = next(p for p in result.prompts if p.example_id == "GetMeeting-level-1-2:2")
    assert meeting.answer[0]["QueryMeeting"]["attendees"] == "['John Smith', 'Jane Doe']"


# ---- splits and identities ------------------------------------------------------------------------------------

@needs_data
def test_hash_split_is_disjoint_complete_deterministic_and_near_the_fraction():
    cfg = task(TaskName.NQ, eval_fraction=0.2)
    train, evaluation = load_prompts(cfg, "train"), load_prompts(cfg, "eval")
    train_uids, eval_uids = {p.prompt_uid for p in train}, {p.prompt_uid for p in evaluation}
    # 3610 rows less 2 whose only answers normalise to "" (")" and "---")
    assert not train_uids & eval_uids and len(train_uids | eval_uids) == 3608
    assert abs(len(eval_uids) / 3608 - 0.2) < 0.03  # binomial sd ~0.007
    assert [p.prompt_uid for p in load_prompts(cfg, "eval")] == [p.prompt_uid for p in evaluation]
    capped = load_prompts(task(TaskName.NQ, eval_fraction=0.2, max_train=7, max_eval=3), "train")
    assert [p.prompt_uid for p in capped] == [p.prompt_uid for p in train[:7]]


@needs_data
def test_api_bank_split_keeps_each_dialogue_on_one_side():
    cfg = task(TaskName.API_BANK, eval_fraction=0.3)
    sides = {}
    for split in ("train", "eval"):
        for p in load_prompts(cfg, split):
            sides.setdefault(p.meta["dialogue"], set()).add(split)
    assert all(len(s) == 1 for s in sides.values()) and {"train", "eval"} == set().union(*sides.values())


@needs_data
def test_eval_file_is_used_when_given_and_no_eval_data_is_an_error():
    aime = task(TaskName.AIME_AMC)  # defaults: train_aime.json / aime.json
    assert len(load_prompts(aime, "train")) == 975 and len(load_prompts(aime, "eval")) == 30
    with pytest.raises(DataError, match="eval_fraction"):
        load_prompts(task(TaskName.GSM8K, train_path="../shared/data/gsm8k/train_first1000.jsonl", eval_fraction=0.0),
                     "eval")


def test_rows_without_ids_in_separate_train_and_eval_files_get_distinct_stable_uids(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [json.dumps({"question": f"T{i}?", "answer": f"#### {i}"}).encode()
                                                   for i in range(3)])
    evaluation = write_lines(tmp_path / "test.jsonl", [json.dumps({"question": f"E{i}?", "answer": f"#### {i}"})
                                                       .encode() for i in range(2)])
    cfg = task(TaskName.GSM8K, train_path=str(train), eval_path=str(evaluation))
    train_prompts = load_prompts(cfg, "train", allowed_roots=[tmp_path])
    eval_prompts = load_prompts(cfg, "eval", allowed_roots=[tmp_path])
    assert [p.prompt_uid for p in train_prompts] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]  # the train file's own ids
    assert [p.prompt_uid for p in eval_prompts] == ["gsm8k/eval:0", "gsm8k/eval:1"]
    assert [p.question for p in eval_prompts] == ["E0?", "E1?"]
    assert [p.prompt_uid for p in load_prompts(cfg, "eval", allowed_roots=[tmp_path])] == \
        [p.prompt_uid for p in eval_prompts]  # stable across loads


def test_own_ids_repeated_in_the_eval_file_do_not_collide_with_the_train_file(tmp_path):
    row = {"test_id": 0, "question": "Who?", "answer": "Me"}
    train = write_lines(tmp_path / "train.json", [json.dumps(row).encode()])
    evaluation = write_lines(tmp_path / "dev.json", [json.dumps({**row, "question": "Whom?"}).encode()])
    cfg = task(TaskName.TWOWIKI, train_path=str(train), eval_path=str(evaluation))
    assert [p.example_id for p in load_prompts(cfg, "train", allowed_roots=[tmp_path])] == ["0"]
    assert [p.example_id for p in load_prompts(cfg, "eval", allowed_roots=[tmp_path])] == ["eval:0"]


@needs_data
def test_default_aime_train_and_eval_files_share_no_prompt_uid():
    aime = task(TaskName.AIME_AMC)  # train_aime.json and aime.json, both without ids
    train_uids = {p.prompt_uid for p in load_prompts(aime, "train")}
    eval_uids = {p.prompt_uid for p in load_prompts(aime, "eval")}
    assert len(train_uids) == 975 and len(eval_uids) == 30 and not train_uids & eval_uids


@needs_data
def test_prompt_uids_never_collide_across_sources():
    uids = []
    for name in (TaskName.BAMBOOGLE, TaskName.NQ, TaskName.TWOWIKI, TaskName.GSM8K, TaskName.MUSIQUE):
        uids += [p.prompt_uid for p in load_prompts(task(name, eval_fraction=0.0, max_train=50), "train")]
    assert len(uids) == len(set(uids)) == 250
    assert {"bamboogle/0", "nq/0", "2wikimultihopqa/0", "gsm8k/0"} <= set(uids)


# ---- bad input ---------------------------------------------------------------------------------------------

GOOD = {"question": "Who?", "answer": "Me"}


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("bad_line, reason", [
    (json.dumps({"question": "Who?"}).encode(), "missing answer"),
    (json.dumps({"question": "   ", "answer": "x"}).encode(), "empty question"),
    (json.dumps({"answer": "x"}).encode(), "missing question"),
    (b'{"question": "caf\xe9?", "answer": "x"}', "not valid UTF-8 (byte 0xe9"),
    (b'{"question": "Who?", "answer": }', "JSON error at column"),
    (b'["a list"]', "must be a JSON object"),
    (json.dumps({"question": "Who?", "answer": []}).encode(), "missing answer"),
    # answers that normalise to "" (punctuation, articles): finish[.] would match them exactly
    (json.dumps({"question": "Who?", "answer": "The"}).encode(), "empty after answer normalisation"),
    (json.dumps({"question": "Who?", "answer": [")", "---"]}).encode(), "empty after answer normalisation"),
])
def test_bad_rows_are_skipped_with_a_count_or_raise_naming_file_and_line(tmp_path, caplog, bad_line, reason):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD).encode(), bad_line, json.dumps(GOOD).encode()])
    skip = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.0, on_bad_row="skip")
    with caplog.at_level(logging.WARNING, logger="trace.data"):
        result = load_split(skip, "train", allowed_roots=[tmp_path])
    assert [p.example_id for p in result.prompts] == ["0", "2"]  # ids are row positions, the bad row included
    assert result.num_skipped == 1
    bad = result.bad_rows[0]
    assert (bad.path, bad.row) == (str(path), "line 2") and reason in bad.reason
    assert "skipped 1 bad rows" in caplog.text and "qa.jsonl line 2" in caplog.text
    strict = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.0, on_bad_row="raise")
    with pytest.raises(DataError, match=r"qa\.jsonl line 2: .*on_bad_row"):
        load_prompts(strict, "train", allowed_roots=[tmp_path])


def test_gsm8k_row_without_a_final_answer_is_bad(tmp_path):
    path = write_lines(tmp_path / "gsm.jsonl", [json.dumps({"question": "Q?", "answer": "It is 3 #### 3"}).encode(),
                                                json.dumps({"question": "Q?", "answer": "no final line"}).encode()])
    result = load_split(task(TaskName.GSM8K, train_path=str(path), eval_fraction=0.0), "train",
                        allowed_roots=[tmp_path])
    assert [p.answer for p in result.prompts] == ["3"] and "####" in result.bad_rows[0].reason


@needs_data
def test_max_solution_steps_keeps_the_gsm8k_problems_with_few_annotated_steps_in_both_splits():
    path = "../shared/data/gsm8k/train_first1000.jsonl"
    whole = {split: load_prompts(task(TaskName.GSM8K, train_path=path), split) for split in ("train", "eval")}
    easy = {split: load_prompts(task(TaskName.GSM8K, train_path=path, max_solution_steps=2), split)
            for split in ("train", "eval")}
    for split in ("train", "eval"):
        assert easy[split] == [p for p in whole[split] if p.meta["solution_steps"] <= 2]
        assert 0 < len(easy[split]) < len(whole[split])
    assert whole["train"][0].meta["solution_steps"] == 2  # Natalia: <<48/2=24>>, <<48+24=72>>
    assert sum(map(len, easy.values())) == 389  # 18 + 48 + 323 of the file's 1,000 have 0, 1, 2 steps
    capped = load_prompts(task(TaskName.GSM8K, train_path=path, max_solution_steps=2, max_train=20), "train")
    assert capped == easy["train"][:20]  # the filter comes before max_train


def test_max_solution_steps_on_a_task_without_solution_steps_is_refused(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps({"question": "Q?", "answer": "Paris"}).encode()])
    with pytest.raises(DataError, match=r"max_solution_steps .*row '0' of .*qa\.jsonl"):
        load_prompts(task(TaskName.NQ, train_path=str(path), eval_fraction=0.0, max_solution_steps=2), "train",
                     allowed_roots=[tmp_path])


def test_qa_aliases_that_normalise_to_nothing_are_dropped_and_the_rest_kept(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps({"question": "Q?", "answer": ["A+", "AB+", "*"]}).encode()])
    result = load_split(task(TaskName.NQ, train_path=str(path), eval_fraction=0.0), "train", allowed_roots=[tmp_path])
    assert result.bad_rows == () and result.prompts[0].answer == ["AB+"]  # "A+" -> "a" -> "" (an article)


@pytest.mark.parametrize("fmt, row", [
    ("gsm8k", {"question": "Q?", "answer": "It costs #### $"}),
    ("math", {"problem": "P?", "answer": "\\text{}"}),
    ("math", {"problem": "P?", "solution": "So $\\boxed{x =}$."}),
])
def test_math_golds_with_nothing_to_compare_are_bad_rows(tmp_path, fmt, row):
    good = {"gsm8k": {"question": "Q?", "answer": "It is #### 3"}, "math": {"problem": "P?", "answer": "3"}}[fmt]
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(row).encode(), json.dumps(good).encode()])
    cfg = task(TaskName.MATH, train_path=str(path), eval_fraction=0.0, format=fmt)
    result = load_split(cfg, "train", allowed_roots=[tmp_path])
    assert [p.answer for p in result.prompts] == ["3"] and result.bad_rows[0].row == "line 1"
    assert "no number and nothing is left after normalisation" in result.bad_rows[0].reason


def test_duplicate_ids_are_bad_rows(tmp_path):
    path = write_lines(tmp_path / "dup.jsonl", [json.dumps({"id": "a", **GOOD}).encode(),
                                                json.dumps({"id": "a", **GOOD}).encode()])
    result = load_split(task(TaskName.NQ, train_path=str(path), eval_fraction=0.0), "train", allowed_roots=[tmp_path])
    assert len(result.prompts) == 1 and "duplicate id 'a'" in result.bad_rows[0].reason


def test_a_broken_json_array_raises_with_its_line_even_when_skipping(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text('[\n  {"question": "Who?", "answer": "Me"},\n  {"question": "Who?" "answer": "Me"}\n]\n')
    with pytest.raises(DataError, match=r"qa\.json: JSON error at line 3"):
        load_prompts(task(TaskName.NQ, train_path=str(path), eval_fraction=0.0), "train", allowed_roots=[tmp_path])
    path.write_bytes(b'[{"question": "Caf\xe9?", "answer": "x"}]')
    with pytest.raises(DataError, match="not valid UTF-8 at line 1"):
        load_prompts(task(TaskName.NQ, train_path=str(path), eval_fraction=0.0), "train", allowed_roots=[tmp_path])


def test_api_bank_dialogue_with_a_broken_line_is_skipped_whole(tmp_path):
    folder = tmp_path / "dialogues"
    folder.mkdir()
    call = {"role": "API", "api_name": "Calculator", "param_dict": {"formula": "1+1"},
            "result": {"api_name": "Calculator", "input": {"formula": "1+1"}, "output": 2.0, "exception": None}}
    good = [json.dumps({"role": "User", "text": "What is 1+1?"}).encode(), json.dumps(call).encode()]
    write_lines(folder / "Calculator-level-1-1.jsonl", good)
    write_lines(folder / "Calculator-level-1-2.jsonl", [good[0], b'{"role": "API", ', json.dumps(call).encode()])
    result = load_split(task(TaskName.API_BANK, train_path=str(folder), eval_fraction=0.0), "train",
                        allowed_roots=[tmp_path])
    assert [p.example_id for p in result.prompts] == ["Calculator-level-1-1:0"]
    assert result.bad_rows[0].row == "line 2" and "dialogue skipped" in result.bad_rows[0].reason
    # without a description file the function is described by the arguments seen in the dialogue
    assert result.prompts[0].meta["functions"][0]["parameters"]["properties"] == {"formula": {"type": "str",
                                                                                             "description": ""}}


def test_unknown_split_format_task_and_missing_file_are_errors(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD).encode()])
    with pytest.raises(ValueError, match="split"):
        load_prompts(task(TaskName.NQ, train_path=str(path)), "test", allowed_roots=[tmp_path])
    with pytest.raises(DataError, match="not a format of task 'nq'"):
        load_prompts(task(TaskName.NQ, train_path=str(path), format="gsm8k"), "train", allowed_roots=[tmp_path])
    with pytest.raises(DataError, match="generates its prompts"):
        load_prompts(TaskConfig(name=TaskName.KGQA), "train")
    with pytest.raises(DataError, match="not found"):
        load_prompts(task(TaskName.NQ, train_path=str(tmp_path / "nope.jsonl")), "train", allowed_roots=[tmp_path])
    odd = write_lines(tmp_path / "odd.jsonl", [b'{"text": "x"}'])
    with pytest.raises(DataError, match="cannot tell the format"):
        load_prompts(task(TaskName.GSM8K, train_path=str(odd)), "train", allowed_roots=[tmp_path])
    with pytest.raises(DataError, match="one JSON object over several lines"):
        load_prompts(task(TaskName.NQ, train_path=str(write_lines(tmp_path / "obj.json", [b"{", b'"a": 1', b"}"]))),
                     "train", allowed_roots=[tmp_path])


def test_paths_outside_the_allowed_roots_are_refused(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD).encode()])
    cfg = task(TaskName.NQ, train_path=str(path), eval_fraction=0.0)
    monkeypatch.delenv("TRACE_DATA_DIRS", raising=False)
    with pytest.raises(DataError, match="outside the allowed data folders.*TRACE_DATA_DIRS"):
        load_prompts(cfg, "train")
    monkeypatch.setenv("TRACE_DATA_DIRS", str(tmp_path))
    assert [p.answer for p in load_prompts(cfg, "train")] == [["Me"]]
    assert resolve_data_path("../shared/data/nq", allowed_roots=None).name == "nq"
    with pytest.raises(DataError):
        resolve_data_path("../../etc/passwd")


# ---- environment construction -----------------------------------------------------------------------------

@needs_data
def test_the_registry_builds_each_kind_and_checks_the_given_prompts():
    hotpot_cfg = TaskConfig(name=TaskName.HOTPOTQA, max_turns=4)
    hotpot = make_environment(hotpot_cfg, 0, prompts=load_prompts(hotpot_cfg, "eval"))
    assert isinstance(hotpot, QAEnvironment) and isinstance(hotpot.retriever, ContextBM25Retriever)
    assert (hotpot.name, hotpot.max_turns, hotpot.top_k) == ("hotpotqa", 4, 3)
    bamboogle = make_environment(task(TaskName.BAMBOOGLE, train_path="../shared/data/bamboogle/"
                                      "bamboogle_test_questions_and_answers.json", corpus_path="../shared/data/"
                                      "musique/hipporag_original_format/musique_train_corpus.json"), 0)
    assert isinstance(bamboogle.retriever, CorpusBM25Retriever) and bamboogle.retriever.num_passages == 1890
    gsm = make_environment(TaskConfig(name=TaskName.GSM8K), 3, prompts=[])
    assert isinstance(gsm, MathEnvironment) and gsm.name == "gsm8k"
    fc = make_environment(TaskConfig(name=TaskName.API_BANK, max_turns=2), 0)
    assert isinstance(fc, FunctionCallingEnvironment) and (fc.name, fc.max_turns) == ("api_bank", 2)
    with pytest.raises(DataError, match="belongs to 'gsm8k'"):
        make_environment(TaskConfig(name=TaskName.MATH), 0,
                         prompts=load_prompts(task(TaskName.GSM8K, max_eval=1), "eval"))


@needs_data
def test_the_registry_builds_every_real_task_through_the_module_factories():
    registry = pytest.importorskip("trace.envs.registry")
    repo_root = Path(__file__).resolve().parents[1]
    kinds = {TaskName.HOTPOTQA: QAEnvironment, TaskName.MUSIQUE: QAEnvironment, TaskName.TWOWIKI: QAEnvironment,
             TaskName.GSM8K: MathEnvironment, TaskName.MATH: MathEnvironment, TaskName.AIME_AMC: MathEnvironment,
             TaskName.BFCL: FunctionCallingEnvironment, TaskName.API_BANK: FunctionCallingEnvironment}
    for name, kind in kinds.items():
        env = registry.make_environment(TaskConfig(name=name, max_turns=3), 0, root=repo_root)
        assert isinstance(env, kind) and env.name == name.value and env.max_turns == 3


# ---- package layout ---------------------------------------------------------------------------------------

def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": "."})


@pytest.mark.parametrize("first", ["trace.envs.qa", "trace.data", "trace.data.splits", "trace.envs.registry"])
def test_the_loaders_and_environments_import_in_any_order(first):
    done = _run_python(f"import {first}\nfrom trace.data import DataError, load_prompts, load_split\n"
                       "from trace.data.splits import load_prompts as direct\nassert load_prompts is direct")
    assert done.returncode == 0, done.stderr


def test_the_paths_module_loads_no_environment():
    done = _run_python("import sys, trace.data_paths\n"
                       "print(sorted(m for m in sys.modules if m.startswith('trace.envs')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- empty and all-bad inputs ------------------------------------------------------------------------------

def test_an_empty_file_is_reported_as_empty_not_as_an_unknown_format(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_bytes(b"\n  \n")
    cfg = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"qa\.jsonl: the file is empty"):
        load_prompts(cfg, "train", allowed_roots=[tmp_path])


def test_a_file_of_unreadable_rows_names_the_first_instead_of_guessing_a_format(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [b"not json", b'["a list"]'])
    cfg = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.0)
    with pytest.raises(DataError, match=r"none of its 2 rows is a JSON object \(first, line 1: JSON error"):
        load_prompts(cfg, "train", allowed_roots=[tmp_path])


def test_a_split_whose_every_row_is_bad_is_refused_with_the_file_and_the_skipped_counts(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps({"question": "Who?"}).encode(),
                                               json.dumps({"answer": "x"}).encode(), b"not json"])
    cfg = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.0, format="qa_pairs")
    with pytest.raises(DataError, match=r"train split of .*qa\.jsonl has no usable prompt: 0 rows parsed, 3 bad "
                                        r"rows skipped \(first: .*line 1: missing answer"):
        load_split(cfg, "train", allowed_roots=[tmp_path])


def test_a_split_that_the_eval_fraction_leaves_empty_is_refused(tmp_path):
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(GOOD).encode()])
    cfg = task(TaskName.BAMBOOGLE, train_path=str(path), eval_fraction=0.5)
    splits = {}
    for split in ("train", "eval"):
        try:
            splits[split] = len(load_prompts(cfg, split, allowed_roots=[tmp_path]))
        except DataError as err:
            assert "1 rows parsed" in str(err) and "eval_fraction=0.5" in str(err)
            splits[split] = str(err)
    assert sorted(v if isinstance(v, int) else -1 for v in splits.values()) == [-1, 1]


# ---- relative data paths resolve against the main repository -----------------------------------------------

def test_relative_data_paths_resolve_against_the_main_repository_of_a_queued_experiment(tmp_path, monkeypatch):
    """``dvc exp run --queue`` runs stages in ``<repo>/.dvc/tmp/exps/<tmp>/`` with ``DVC_ROOT`` = the main
    repository: ``../shared/data/...`` must mean the main repository's neighbour, not the copy's."""
    main = tmp_path / "work" / "main"
    shared = tmp_path / "work" / "shared" / "data" / "nq"
    shared.mkdir(parents=True)
    write_lines(shared / "questions.jsonl", [json.dumps(GOOD).encode()])
    copy = main / ".dvc" / "tmp" / "exps" / "tmpabc"
    copy.mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(main))
    monkeypatch.delenv("TRACE_DATA_DIRS", raising=False)
    cfg = task(TaskName.NQ, train_path="../shared/data/nq/questions.jsonl", eval_fraction=0.0)
    assert resolve_data_path(cfg.files.train_path) == (shared / "questions.jsonl").resolve()
    assert [p.answer for p in load_prompts(cfg, "train")] == [["Me"]]
