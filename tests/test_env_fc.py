import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace.configuration.config import DataFileConfig, TaskConfig, TaskName
from trace.data.splits import load_prompts
from trace.envs.base import EpisodeFinishedError
from trace.envs.api_bank import check_api_bank_calls
from trace.envs.bfcl import _assign, check_bfcl_calls, standardize_string
from trace.envs.calls import CallSyntaxError, FunctionCall, parse_calls, render_call
from trace.envs.fc import FunctionCallingEnvironment
from trace.envs.registry import make_environment

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"offline data folder {SHARED_DATA} not present")

try:
    from trace.envs.checker import check_environment
except ImportError:  # pragma: no cover - the checker lives in its own module
    check_environment = None
needs_checker = pytest.mark.skipif(check_environment is None, reason="trace.envs.checker not available")


@pytest.fixture(scope="module")
def bfcl():
    """Every BFCL single-turn item of the offline copy, by example id."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"offline data folder {SHARED_DATA} not present")
    cfg = TaskConfig(name=TaskName.BFCL, files=DataFileConfig(eval_fraction=0.0))
    return {p.example_id: p for p in load_prompts(cfg, "train")}


def score(prompt, text):
    """Reward of one call text on a BFCL / API-Bank prompt, through the environment."""
    env = FunctionCallingEnvironment(prompt.data_source)
    state, _ = env.reset(prompt)
    return env.step(state, f"Thought: go. Action: call[{text}]").reward


# ---- parsing --------------------------------------------------------------------------------------------

def test_parse_calls_reads_lists_single_calls_dotted_names_and_literals():
    calls = parse_calls('[spotify.play(artist="Taylor Swift", duration=20), g(x=-1.5, y=[1, (2, 3)], z={"k": null}, '
                        'b=true)]')
    assert calls == [FunctionCall("spotify.play", {"artist": "Taylor Swift", "duration": 20}),
                     FunctionCall("g", {"x": -1.5, "y": [1, [2, 3]], "z": {"k": None}, "b": True})]
    assert parse_calls("f()") == [FunctionCall("f", {})]


def test_render_call_round_trips():
    arguments = {"a": 1, "b": "it's", "c": [1.5, None, True], "d": {"x": "y"}}
    assert parse_calls(render_call("m.f", arguments)) == [FunctionCall("m.f", arguments)]


@pytest.mark.parametrize("text", [
    "f(1)",  # positional
    "f(**{'a': 1})",
    "f(a=b)",  # bare name
    "f(a=g(1))",  # nested call
    "f(a=1+2)",  # expression
    "f(a=lambda: 1)",
    "f(a=x.y)",
    "f(a=[1][0])",
    "f(a={1, 2})",
    "f(a=[*x])",
    "[]",
    "f(a=1",
    "f(a=1, a=2)",
    "42",
    "__import__('os').system('touch pwned')",
    "getattr(f, 'x')()",
    "",
    "f(a='" + "x" * 5000 + "')",
])
def test_parse_calls_refuses_anything_but_literal_keyword_calls(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CallSyntaxError):
        parse_calls(text)
    assert not (tmp_path / "pwned").exists()


# ---- BFCL checker on real rows ------------------------------------------------------------------------------

def test_bfcl_gold_answers_score_one_in_every_category(bfcl):
    env = FunctionCallingEnvironment("bfcl")
    categories = {}
    for prompt in bfcl.values():
        categories.setdefault(prompt.meta["category"], []).append(prompt)
    assert {c: len(v) for c, v in categories.items() if not c.startswith("live")} == {
        "simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}
    for category, prompts in categories.items():
        if category == "live_relevance":  # no gold call (any call counts): no demonstration
            assert all(env.solve(prompt) == [] for prompt in prompts)
            continue
        for prompt in prompts:
            state, _ = env.reset(prompt)
            result = env.step(state, env.solve(prompt)[0])
            assert result.reward == 1.0, (prompt.example_id, result.info)


@pytest.mark.parametrize("call, reward", [
    ("calculate_triangle_area(base=10, height=5)", 1.0),  # optional unit omitted ("" is acceptable)
    ("calculate_triangle_area(base=10, height=5, unit='units')", 1.0),
    ("calculate_triangle_area(height=5, base=10, unit='UNITS')", 1.0),  # strings compared standardised
    ("calculate_triangle_area(base=11, height=5)", 0.0),  # wrong value
    ("calculate_triangle_area(base=10)", 0.0),  # missing required argument
    ("calculate_triangle_area(base=10, height=5, color='red')", 0.0),  # unknown argument
    ("calculate_triangle_area(base=True, height=5)", 0.0),  # bool is not an integer
    ("calculate_triangle_area(base=10.0, height=5)", 0.0),  # float is not an integer
    ("calculate_triangle_area(base='10', height=5)", 0.0),
    ("calculate_area(base=10, height=5)", 0.0),  # wrong function
    ("[calculate_triangle_area(base=10, height=5), calculate_triangle_area(base=10, height=5)]", 0.0),
])
def test_bfcl_simple_python_0(bfcl, call, reward):
    assert bfcl["simple_python_0"].answer == [{"calculate_triangle_area": {"base": [10], "height": [5],
                                                                           "unit": ["units", ""]}}]
    assert score(bfcl["simple_python_0"], call) == reward


def test_bfcl_types_and_optional_arguments_on_real_rows(bfcl):
    # simple_python_30: initial_velocity is a float, acceptable ["", 0.0]: an int is accepted for a float
    assert score(bfcl["simple_python_30"], "kinematics.final_velocity_from_distance(acceleration=4, distance=300, "
                                           "initial_velocity=0)") == 1.0
    # simple_python_17: formatted is a boolean: 1 is not True here
    assert score(bfcl["simple_python_17"], "get_prime_factors(number=450, formatted=True)") == 1.0
    assert score(bfcl["simple_python_17"], "get_prime_factors(number=450, formatted=1)") == 0.0
    # simple_python_7: unit is optional for the function, but the answer has no "" for it: it must be given
    assert score(bfcl["simple_python_7"], "calculate_circumference(radius=4, unit='in')") == 1.0
    assert score(bfcl["simple_python_7"], "calculate_circumference(radius=4)") == 0.0
    # simple_python_36: "Washington D.C." and "washington dc" standardise alike
    assert score(bfcl["simple_python_36"], "get_shortest_driving_distance(origin='new york city', "
                                           "destination='washington dc')") == 1.0
    # simple_python_37: a list must equal one acceptable list, in its order
    base = "route.estimate_time(start_location='San Francisco', end_location='Los Angeles', stops={})"
    assert score(bfcl["simple_python_37"], base.format("['Monterey', 'Santa Barbara']")) == 1.0
    assert score(bfcl["simple_python_37"], base.format("['Monterey']")) == 0.0


def test_bfcl_dict_arguments_on_a_real_row(bfcl):
    prompt = bfcl["multiple_8"]  # budget: {'min': [300000], 'max': [400000]}
    call = ("realestate.find_properties(location='San Diego, CA', propertyType='villa', bedrooms=3, "
            "budget={{'min': {}, 'max': 400000}})")
    assert score(prompt, call.format(300000)) == 1.0
    assert score(prompt, call.format(300001)) == 0.0


def test_bfcl_parallel_calls_match_in_any_order_with_the_same_count(bfcl):
    prompt = bfcl["parallel_0"]
    taylor = "spotify.play(artist='Taylor Swift', duration=20)"
    maroon = "spotify.play(artist='Maroon 5', duration=15)"
    assert score(prompt, f"[{taylor}, {maroon}]") == 1.0
    assert score(prompt, f"[{maroon}, {taylor}]") == 1.0
    assert score(prompt, f"[{taylor}]") == 0.0
    assert score(prompt, f"[{taylor}, {taylor}]") == 0.0
    assert score(prompt, f"[{taylor}, {maroon}, {maroon}]") == 0.0


def test_bfcl_irrelevance_rewards_finishing_without_a_call(bfcl):
    prompt = bfcl["irrelevance_0"]
    env = FunctionCallingEnvironment("bfcl")
    state, message = env.reset(prompt)
    assert "determine_body_mass_index" in message and "Request:\nCalculate the area of a triangle" in message
    assert env.step(state, "Thought: nothing fits. Action: finish[]").reward == 1.0
    assert env.step(state, "Action: call[determine_body_mass_index(weight=10.0, height=5.0)]").reward == 0.0


def test_bfcl_checker_needs_a_call_for_relevant_items():
    assert not check_bfcl_calls([], [{"name": "f", "parameters": {}}], [{"f": {}}], "simple_python").valid
    assert check_bfcl_calls([FunctionCall("f", {})], [{"name": "f", "parameters": {}}], None, "live_relevance").valid


def test_standardize_string_is_bfcl_s():
    assert standardize_string("April 1, 2024") == standardize_string("april 1 2024") == "april12024"
    assert standardize_string("it's") == 'it"s'


LOAD = [{"name": "load", "parameters": {"type": "dict", "properties": {
    "path": {"type": "string"}, "delimiter": {"type": "string"}, "columns": {"type": "array",
                                                                         "items": {"type": "string"}}},
    "required": ["path"]}}]


@pytest.mark.parametrize("delimiter, valid", [(",", True), ("", True), (".", False), ("-", False), (" ", False),
                                              (";", False)])
def test_a_punctuation_gold_that_standardises_to_nothing_matches_only_itself(delimiter, valid):
    # BFCL's parallel_multiple_21 has delimiter [",", ""]: standardised, "," is "" and would equal "." or "-"
    gold = [{"load": {"path": ["data.csv"], "delimiter": [",", ""]}}]
    call = FunctionCall("load", {"path": "data.csv", "delimiter": delimiter})
    assert check_bfcl_calls([call], LOAD, gold, "simple_python").valid is valid


def test_an_empty_string_does_not_match_a_required_punctuation_value():
    gold = [{"load": {"path": ["data.csv"], "delimiter": [","], "columns": [[".", "a"]]}}]
    assert check_bfcl_calls([FunctionCall("load", {"path": "data.csv", "delimiter": ",", "columns": [".", "a"]})],
                            LOAD, gold, "simple_python").valid
    for bad in ({"delimiter": ""}, {"delimiter": "_"}, {"columns": ["", "a"]}):
        call = FunctionCall("load", {"path": "data.csv", "delimiter": ",", "columns": [".", "a"], **bad})
        assert not check_bfcl_calls([call], LOAD, gold, "simple_python").valid, bad
    api_gold = [{"Search": {"keyword": "-"}}]
    assert check_api_bank_calls([FunctionCall("Search", {"keyword": "-"})], api_gold).valid
    assert not check_api_bank_calls([FunctionCall("Search", {"keyword": ""})], api_gold).valid
    assert not check_api_bank_calls([FunctionCall("Search", {"keyword": "."})], api_gold).valid


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5).flatmap(lambda n: st.lists(st.lists(st.booleans(), min_size=n, max_size=n),
                                                    min_size=n, max_size=n)))
def test_parallel_assignment_agrees_with_brute_force_over_permutations(matches):
    n = len(matches)
    brute = any(all(matches[g][perm[g]] for g in range(n)) for perm in itertools.permutations(range(n)))
    owner = _assign(matches)
    assert (owner is not None) == brute
    if owner is not None:  # a valid one-to-one assignment gold -> call
        assert sorted(owner) == list(range(n)) and all(matches[owner[c]][c] for c in range(n))


# ---- API-Bank -------------------------------------------------------------------------------------------

def test_api_bank_value_comparison():
    gold = [{"AddMeeting": {"token": "a9", "attendees": "['John Smith', 'Jane Doe']", "room_count": "1"}}]
    good = FunctionCall("AddMeeting", {"token": "a9", "attendees": ["John Smith", "Jane Doe"], "room_count": 1})
    assert check_api_bank_calls([good], gold).valid
    wrong = FunctionCall("AddMeeting", {"token": "a8", "attendees": ["John Smith", "Jane Doe"], "room_count": 1})
    assert not check_api_bank_calls([wrong], gold).valid
    extra = FunctionCall("AddMeeting", {**good.arguments, "location": "here"})
    assert not check_api_bank_calls([extra], gold).valid
    missing = FunctionCall("AddMeeting", {"token": "a9", "attendees": ["John Smith", "Jane Doe"]})
    assert not check_api_bank_calls([missing], gold).valid
    assert not check_api_bank_calls([good, good], gold).valid


@needs_data
def test_api_bank_real_dialogue_calls():
    cfg = TaskConfig(name=TaskName.API_BANK, files=DataFileConfig(eval_fraction=0.0))
    prompts = {p.example_id: p for p in load_prompts(cfg, "train")}
    assert len(prompts) == 389  # one per API call in the 214 dialogues
    calculator = prompts["Calculator-level-1-1:0"]
    assert calculator.answer == [{"Calculator": {"formula": "(5+6)*3"}}]
    assert calculator.question == ("The current year is 2023.\nUser: Can you calculate (5+6)*3 for me?\n"
                                   "AI: Sure, let me handle that.")
    assert calculator.meta["functions"][0]["parameters"]["required"] == ["formula"]
    assert score(calculator, "Calculator(formula='(5+6)*3')") == 1.0
    assert score(calculator, "Calculator(formula='(5+6)*4')") == 0.0
    assert score(calculator, "Calculator(expression='(5+6)*3')") == 0.0
    # the second call of a dialogue sees the first call and its result in its history
    agenda = prompts["AddAgenda-level-1-1:1"]
    history_line = "API-Request: [GetUserToken(username='foo', password='bar')]->{'token': 'z9x8c7v6b5n4m3q2w1'}"
    assert history_line in agenda.question
    assert score(agenda, "AddAgenda(token='z9x8c7v6b5n4m3q2w1', content='Meeting with the marketing team', "
                         "time='2021-09-28 14:00:00', location='Conference room')") == 1.0
    assert score(agenda, "AddAgenda(token='z9x8c7v6b5n4m3q2w1', content='Meeting with the marketing team', "
                         "time='2021-09-28 15:00:00', location='Conference room')") == 0.0
    env = FunctionCallingEnvironment("api_bank")
    for prompt in prompts.values():
        state, _ = env.reset(prompt)
        assert env.step(state, env.solve(prompt)[0]).reward == 1.0, prompt.example_id


# ---- environment ----------------------------------------------------------------------------------------

def test_unparseable_calls_are_observations_and_a_parsed_call_ends_the_episode(bfcl):
    env = FunctionCallingEnvironment("bfcl", max_turns=3)
    state, _ = env.reset(bfcl["simple_python_1"])
    bad = env.step(state, "Action: call[math.factorial(5)]")
    assert bad.observation.startswith("Invalid action:") and "positional" in bad.observation
    assert not bad.state.done and bad.num_tool_calls == 0
    good = env.step(bad.state, "Action: call[[math.factorial(number=5)]] Observation: fake")
    assert good.terminated and good.reward == 1.0 and good.num_tool_calls == 1
    assert good.info["calls"] == [{"name": "math.factorial", "arguments": {"number": 5}}]
    with pytest.raises(EpisodeFinishedError):
        env.step(good.state, "Action: finish[]")


def test_turn_limit_truncates_without_a_call(bfcl):
    env = FunctionCallingEnvironment("bfcl", max_turns=2)
    state, _ = env.reset(bfcl["simple_python_1"])
    state = env.step(state, "no action").state
    last = env.step(state, "Action: search[x]")
    assert last.truncated and not last.terminated and last.reward == 0.0


@needs_checker
def test_function_calling_environments_pass_the_checker(bfcl):
    env = make_environment(TaskConfig(name=TaskName.BFCL), 0)
    prompts = [bfcl[i] for i in ("simple_python_0", "multiple_8", "parallel_0", "parallel_multiple_0", "irrelevance_0",
                                 "live_parallel_0-0-0")]
    check_environment(env, prompts, num_random_episodes=12)
    cfg = TaskConfig(name=TaskName.API_BANK, files=DataFileConfig(max_eval=3))
    api_prompts = load_prompts(cfg, "eval")
    check_environment(make_environment(cfg, 0, prompts=api_prompts), api_prompts, num_random_episodes=6)
