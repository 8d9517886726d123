import json
import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace.configuration.config import DataFileConfig, TaskConfig, TaskName
from trace.data.splits import load_prompts
from trace.envs.answers import extract_boxed, is_empty_math_answer, math_answers_match, parse_number
from trace.envs.base import EpisodeFinishedError, Prompt
from trace.envs.math import (CalculatorError, MathEnvironment, format_number, gsm8k_calculations, gsm8k_final_answer,
                             safe_calculate)
from trace.envs.registry import make_environment

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"offline data folder {SHARED_DATA} not present")

try:
    from trace.envs.checker import check_environment
except ImportError:  # pragma: no cover - the checker lives in its own module
    check_environment = None
needs_checker = pytest.mark.skipif(check_environment is None, reason="trace.envs.checker not available")


def math_prompt(answer: str, question: str = "What is 6 * 7?", **meta) -> Prompt:
    return Prompt("gsm8k", "t0", question, answer, meta)


# ---- calculator ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, expected", [
    ("48/2", "24"),
    ("48 + 24", "72"),
    ("1,234 * 2", "2468"),  # thousands separator
    ("2^10", "1024"),  # ^ read as a power
    ("7/3", "2.333333333"),  # 10 significant digits
    ("0.1 + 0.2", "0.3"),  # exact decimals, not binary floats
    ("2**-2", "0.25"),
    ("-(3 - 5) * 4 % 5", "3"),  # 8 % 5
    ("17 // 5", "3"),
    ("(-1)**(10**9)", "1"),  # huge exponent of -1 is cheap and allowed
    ("2**0.5", "1.414213562"),
    ("12 * 3 =", "36"),  # a trailing '=' is ignored
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert format_number(safe_calculate(expression)) == expected


def test_calculator_is_exact_in_fractions():
    assert safe_calculate("0.1 + 0.2") == Fraction(3, 10)
    assert safe_calculate("1/3 + 1/6") == Fraction(1, 2)


@pytest.mark.parametrize("expression", [
    "__import__('os').system('echo hacked')",
    "x + 1",  # names
    "(1).real",  # attributes
    "abs(-3)",  # calls
    "lambda: 1",
    "[i for i in range(10)]",
    "{i: i for i in range(3)}",
    "(1, 2)[0]",  # subscript
    "'a' * 3",  # strings
    "True + 1",  # booleans are not numbers here
    "1 if 1 else 2",
    "3 > 2",
    "1 and 2",
    "1 << 10",  # bit operators
    "9**9**9",  # would take minutes to compute
    "10**10000",
    "2**(2**20)",
    "(10**300) * (10**300) * (10**300) * (10**300)",
    "1" * 201,  # over the length limit
    "(" * 150 + "1" + ")" * 150,
    "1/0",
    "0**-1",
    "(-8)**(1/3)",
    "",
    "\x00",
    "1e999",
])
def test_calculator_refuses_unsafe_or_unbounded_input_quickly(expression):
    start = time.perf_counter()
    with pytest.raises(CalculatorError):
        safe_calculate(expression)
    assert time.perf_counter() - start < 0.05


def test_calculator_refuses_long_input_before_parsing():
    start = time.perf_counter()
    with pytest.raises(CalculatorError, match="limit is 200"):
        safe_calculate("1+" * 500_000 + "1")
    assert time.perf_counter() - start < 0.05


@st.composite
def expressions(draw, depth=0):
    """(expression text, its exact value) built together, so the value is known without evaluating text."""
    if depth >= 3 or draw(st.booleans()):
        value = draw(st.integers(-50, 50))
        return (f"({value})" if value < 0 else str(value)), Fraction(value)
    left_text, left = draw(expressions(depth=depth + 1))
    right_text, right = draw(expressions(depth=depth + 1))
    op = draw(st.sampled_from(["+", "-", "*", "/"]))
    if op == "/" and right == 0:
        op = "+"
    value = {"+": left + right, "-": left - right, "*": left * right, "/": left / right if right else None}[op]
    return f"({left_text} {op} {right_text})", value


@settings(max_examples=150, deadline=None)
@given(expressions())
def test_calculator_matches_exact_fraction_arithmetic(pair):
    text, value = pair
    assert safe_calculate(text) == value


# ---- answer extraction and comparison ------------------------------------------------------------------------

@pytest.mark.parametrize("prediction", ["1234", "1,234", "1234.0", "$1234", "$1,234.00", "1234 dollars",
                                        "\\boxed{1234}", "x = 1234", "1234."])
def test_numeric_answer_forms_match_1234(prediction):
    assert math_answers_match(prediction, "1234")


@pytest.mark.parametrize("prediction", ["12345", "123", "1,2345", "1234.5", "", "twelve", "\\boxed{}"])
def test_numeric_near_misses_do_not_match_1234(prediction):
    assert not math_answers_match(prediction, "1234")


@pytest.mark.parametrize("prediction, gold", [
    ("\\frac{1}{2}", "0.5"), ("1/2", "\\dfrac{1}{2}"), ("25", "025"), ("-3", "-3.0"),
    ("\\frac{\\sqrt3}{2}", "\\dfrac{\\sqrt{3}}{2}"), ("(1, 2)", "(1,2)"), ("\\left( 3, 4 \\right)", "(3,4)"),
    ("10\\%", "10"), ("90^\\circ", "90"),
])
def test_math_answers_that_are_equal(prediction, gold):
    assert math_answers_match(prediction, gold)


@pytest.mark.parametrize("prediction, gold", [("x^2+1", "x^2+2"), ("(1,2)", "(2,1)"), ("\\frac{1}{3}", "0.33")])
def test_math_answers_that_differ(prediction, gold):
    assert not math_answers_match(prediction, gold)


def test_parse_number_reads_fractions_exactly_and_refuses_tuples():
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("-\\frac{3}{4}") == Fraction(-3, 4)
    assert parse_number("1,2") is None
    assert parse_number("3/0") is None


def test_extract_boxed_takes_the_last_box_with_nested_braces():
    assert extract_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed 7 is it") == "7"
    assert extract_boxed("no box") is None
    assert extract_boxed("\\boxed{unclosed") is None


def test_gsm8k_solution_parsing():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 1,072"
    assert gsm8k_final_answer(solution) == "1072"
    assert gsm8k_calculations(solution) == ["48/2", "48+24"]
    assert gsm8k_final_answer("no final line") is None


def test_only_annotations_the_calculator_confirms_become_demonstrated_calls():
    solution = ("<<48/2=24>> <<5x=10>> <<2+2=5>> <<1/3=0.3333333>> <<1,200*2=2,400>> <<3*4=12.0>> <<7-1=six>>")
    assert gsm8k_calculations(solution) == ["48/2", "1/3", "1,200*2", "3*4"]


# ---- environment --------------------------------------------------------------------------------------------

def test_calculate_then_finish_scores_the_gold_answer():
    env = MathEnvironment("gsm8k", max_turns=4)
    state, message = env.reset(math_prompt("42"))
    assert "Problem: What is 6 * 7?" in message and "calculate[expression]" in message
    result = env.step(state, "Thought: multiply. Action: calculate[6 * 7] Observation:")
    assert (result.observation, result.num_tool_calls, result.terminated, result.truncated) == ("42", 1, False, False)
    final = env.step(result.state, "Thought: done. Action: finish[42]")
    assert final.terminated and final.reward == 1.0 and final.observation == ""
    assert final.state.data == (("calculate", "6 * 7"), ("finish", "42"))


def test_calculator_error_is_an_observation():
    env = MathEnvironment("gsm8k")
    state, _ = env.reset(math_prompt("42"))
    result = env.step(state, "Action: calculate[9**9**9]")
    assert result.observation.startswith("Calculator error:") and not result.state.done
    assert "calculator_error" in result.info


def test_boxed_answer_without_an_action_ends_the_episode():
    env = MathEnvironment("gsm8k")
    state, _ = env.reset(math_prompt("42"))
    result = env.step(state, "Thought: 6 * 7 is \\boxed{42}.")
    assert result.terminated and result.reward == 1.0 and result.info["answer_source"] == "boxed"


def test_explicit_action_takes_precedence_over_a_box_in_the_thought():
    env = MathEnvironment("gsm8k")
    state, _ = env.reset(math_prompt("42"))
    result = env.step(state, "Thought: maybe \\boxed{41}? Action: calculate[6*7]")
    assert not result.state.done and result.observation == "42"


def test_text_after_the_observation_marker_is_ignored():
    env = MathEnvironment("gsm8k")
    state, _ = env.reset(math_prompt("42"))
    result = env.step(state, "Action: calculate[1+1] Observation: 42 Action: finish[42]")
    assert result.observation == "2" and not result.state.done


@pytest.mark.parametrize("text", ["", "   ", "I think so.", "Action: compute[1+1]", "Action: finish[]",
                                  "Action: calculate[]", "Action: calculate[1+1"])
def test_malformed_turns_give_invalid_action_observations(text):
    env = MathEnvironment("gsm8k")
    state, _ = env.reset(math_prompt("42"))
    result = env.step(state, text)
    assert result.observation.startswith("Invalid action:") and not result.state.done
    assert result.reward == 0.0 and "parse_error" in result.info


def test_turn_limit_truncates_and_finished_states_refuse_steps():
    env = MathEnvironment("gsm8k", max_turns=2)
    state, _ = env.reset(math_prompt("42"))
    state = env.step(state, "Action: calculate[1]").state
    last = env.step(state, "Action: calculate[2]")
    assert last.truncated and not last.terminated and last.reward == 0.0 and last.observation == ""
    with pytest.raises(EpisodeFinishedError):
        env.step(last.state, "Action: finish[42]")


def test_reset_refuses_prompts_of_another_source():
    with pytest.raises(ValueError, match="gsm8k"):
        MathEnvironment("gsm8k").reset(Prompt("aime_amc", "0", "q", "1"))


@pytest.mark.parametrize("empty", ["", "$", "x =", "\\text{}", ".", "%"])
def test_empty_answers_never_match_and_empty_golds_are_refused_at_reset(empty):
    assert is_empty_math_answer(empty)
    for prediction in ("", ".", "$", "x =", "\\boxed{}", empty):
        assert not math_answers_match(prediction, empty)
    with pytest.raises(ValueError, match="gsm8k/t0"):
        MathEnvironment("gsm8k").reset(math_prompt(empty))


@pytest.mark.parametrize("answer", ["0", "x", "\\frac{1}{2}", "-", "(1,2)"])
def test_answers_with_a_number_or_a_symbol_are_not_empty(answer):
    assert not is_empty_math_answer(answer)
    MathEnvironment("gsm8k").reset(math_prompt(answer))


@needs_data
def test_real_gsm8k_golds_score_one_and_near_misses_zero():
    cfg = TaskConfig(name=TaskName.GSM8K, files=DataFileConfig(eval_fraction=0.0, max_train=200))
    prompts = load_prompts(cfg, "train")
    env = make_environment(cfg, 0, prompts=prompts)
    large = [p for p in prompts if int(float(p.answer)) >= 1000]
    assert large, "expected some answers >= 1000 among the first 200 problems"
    for prompt in prompts[:50] + large[:5]:
        state, _ = env.reset(prompt)
        gold = int(float(prompt.answer))
        assert env.step(state, f"Action: finish[{prompt.answer}]").reward == 1.0
        assert env.step(state, f"Action: finish[${gold:,}.00]").reward == 1.0
        assert env.step(state, f"Action: finish[{gold * 10 + 5}]").reward == 0.0
        assert env.step(state, f"Action: finish[{gold + 1}]").reward == 0.0
    # the first problem's demonstration replays the solution's calculator annotations: 48/2 then 48+24
    first = prompts[0]
    assert first.meta["calculations"] == ["48/2", "48+24"]
    state, _ = env.reset(first)
    observations = []
    for action in env.solve(first):
        result = env.step(state, action)
        observations.append(result.observation)
        state = result.state
    assert observations == ["24", "72", ""] and result.reward == 1.0


@needs_data
def test_real_aime_and_amc_golds():
    aime = json.loads((SHARED_DATA / "aime_amc" / "aime.json").read_text())
    amc = json.loads((SHARED_DATA / "aime_amc" / "amc.json").read_text())
    env = MathEnvironment("aime_amc")
    cfg = TaskConfig(name=TaskName.AIME_AMC)
    prompts = load_prompts(cfg, "eval")  # aime.json by default
    assert [p.answer for p in prompts[:2]] == [aime[0]["answer"], aime[1]["answer"]] == ["204", "025"]
    state, _ = env.reset(prompts[1])
    assert env.step(state, "Action: finish[25]").reward == 1.0  # "025" is 25
    assert env.step(state, "Action: finish[250]").reward == 0.0
    amc_prompt = Prompt("aime_amc", "amc0", amc[0]["problem"], "142", {})
    assert amc[0]["answer"] == 142.0
    state, _ = env.reset(amc_prompt)
    assert env.step(state, "The value is \\boxed{142}.").reward == 1.0


@needs_checker
@needs_data
def test_math_environments_pass_the_checker(tmp_path):
    gsm = TaskConfig(name=TaskName.GSM8K, files=DataFileConfig(max_eval=3))
    check_environment(make_environment(gsm, 0), load_prompts(gsm, "eval"), num_random_episodes=8)
    aime = TaskConfig(name=TaskName.AIME_AMC, files=DataFileConfig(max_eval=3))
    check_environment(make_environment(aime, 0), load_prompts(aime, "eval"), num_random_episodes=8)
    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "level": "Level 1",
                                     "type": "Algebra", "solution": "It is $\\boxed{\\frac{3}{4}}$."}) + "\n")
    math_cfg = TaskConfig(name=TaskName.MATH, files=DataFileConfig(train_path=str(math_file), eval_fraction=0.0))
    prompts = load_prompts(math_cfg, "train", allowed_roots=[tmp_path])
    env = make_environment(math_cfg, 0, prompts=prompts)
    check_environment(env, prompts, num_random_episodes=4)
    state, _ = env.reset(prompts[0])
    assert env.step(state, "Action: finish[0.75]").reward == 1.0
