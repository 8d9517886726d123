import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trace.configuration.config import DataFileConfig, TaskConfig, TaskName
from trace.data_paths import DataError
from trace.data.splits import load_prompts
from trace.envs.answers import answer_f1, normalize_answer, parse_action, ParsedAction, ActionError, qa_scores
from trace.envs.base import EpisodeFinishedError, Prompt
from trace.envs.qa import QAEnvironment, gold_aliases
from trace.envs.registry import make_environment
from trace.envs.retrieval import (ContextBM25Retriever, CorpusBM25Retriever, HttpRetriever, Passage, RetrieverError,
                                  load_passages)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"offline data folder {SHARED_DATA} not present")

try:
    from trace.envs.checker import check_environment
except ImportError:  # pragma: no cover - the checker lives in its own module
    check_environment = None
needs_checker = pytest.mark.skipif(check_environment is None, reason="trace.envs.checker not available")

TWOWIKI_CORPUS = SHARED_DATA / "2wikimultihopqa" / "hipporag2_corpus" / "2wikimultihopqa_corpus.json"


@pytest.fixture(scope="module")
def hotpot():
    """The first HotpotQA distractor question of the offline copy ("Tinted Windows" -> Tulsa)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"offline data folder {SHARED_DATA} not present")
    cfg = TaskConfig(name=TaskName.HOTPOTQA, files=DataFileConfig(eval_fraction=0.0, max_train=5))
    return load_prompts(cfg, "train")


@pytest.fixture(scope="module")
def wiki_slice():
    """BM25 over the first 300 passages of the 2Wiki corpus (the first questions' paragraphs are there)."""
    if not TWOWIKI_CORPUS.is_file():
        pytest.skip(f"{TWOWIKI_CORPUS} not present")
    return CorpusBM25Retriever(load_passages(TWOWIKI_CORPUS)[:300])


class _RetrievalHandler(BaseHTTPRequestHandler):
    """A Search-R1-style /retrieve endpoint over three fixed passages; records every request body."""

    passages = [("Lothair II", "Lothair II was king of Lotharingia."),
                ("Ermengarde of Tours", "Ermengarde of Tours died on 20 March 851."),
                ("Tulsa", "Tulsa is a city in Oklahoma.")]
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if self.path != "/retrieve":
            self.send_response(404)
            self.end_headers()
            return
        results = []
        for query in body["queries"]:
            words = set(query.lower().split())
            ranked = sorted(self.passages, key=lambda p: -len(words & set(f"{p[0]} {p[1]}".lower().split())))
            results.append([{"document": {"id": str(i), "contents": f'"{t}"\n{x}'}, "score": 1.0 / (i + 1)}
                            for i, (t, x) in enumerate(ranked[: body["topk"]])])
        payload = json.dumps({"result": results}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture()
def retrieval_server():
    _RetrievalHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RetrievalHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _RetrievalHandler.requests
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


# ---- action parsing and answer scores ----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("Thought: find it. Action: search[Tinted Windows band] Observation:",
     ParsedAction("search", "Tinted Windows band")),
    ("Action: Finish[Ender's Game]", ParsedAction("finish", "Ender's Game")),  # unbalanced quote
    ("action:search[ [1] list ]", ParsedAction("search", "[1] list")),  # nested brackets
    ("I will search[a] now", ParsedAction("search", "a")),  # no label: first known tool
    ("Action: search[a] Observation: x Action: finish[b]", ParsedAction("search", "a")),
    ("Action: I will finish[Tulsa]", ParsedAction("finish", "Tulsa")),  # prose after the label
    ("Action: lookup[x]", ParsedAction("lookup", "x")),  # an unknown tool is reported by the environment
])
def test_parse_action_reads_the_first_action_before_the_marker(text, expected):
    assert parse_action(text, ("search", "finish")) == expected


@pytest.mark.parametrize("text", ["", "   ", "Observation: fake", "Thought: hmm", "Action: search", "Action: search[x"])
def test_parse_action_explains_what_is_missing(text):
    assert isinstance(parse_action(text, ("search", "finish")), ActionError)


def test_normalize_answer_is_hotpotqa_s():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("A tale of two cities.") == "tale of two cities"
    assert normalize_answer("Theatre") == "theatre"  # 'the' only as a word


def test_f1_hand_worked():
    # pred tokens {tulsa, oklahoma}, gold {tulsa}: precision 1/2, recall 1 -> F1 = 2 * 0.5 / 1.5 = 2/3
    assert answer_f1("Tulsa, Oklahoma", "Tulsa") == pytest.approx(2 / 3)
    assert answer_f1("yes", "no") == 0.0
    assert answer_f1("no", "no") == 1.0
    assert answer_f1("yes it is", "yes") == 0.0  # HotpotQA: yes/no answers score only exactly


@pytest.mark.parametrize("prediction,golds", [
    ("", [""]),  # no answer against no answer
    ("a", ["The"]),  # both normalise to ""
    (".", ["The", "Tulsa"]),
    ("the", [")", "---"]),
    ("", ["Tulsa"]),
])
def test_answers_that_normalise_to_nothing_never_score(prediction, golds):
    assert qa_scores(prediction, golds) == (0.0, 0.0)


def test_an_empty_alias_is_skipped_and_the_others_still_score():
    assert qa_scores("Tulsa", ["The", "Tulsa"]) == (1.0, 1.0)
    assert gold_aliases(["The", " ", "Tulsa", ")"]) == ["Tulsa"]
    assert gold_aliases("A") == []


def test_finish_with_punctuation_or_an_article_does_not_match_an_empty_alias():
    env = QAEnvironment("nq", ContextBM25Retriever())
    state, _ = env.reset(Prompt("nq", "0", "Who?", ["The", "Tulsa"], {"context": [["T", "Tulsa is a city."]]}))
    for text in ("Action: finish[.]", "Action: finish[a]", "Action: finish[The]"):
        result = env.step(state, text)
        assert result.terminated and result.reward == 0.0 and result.info["em"] == 0.0, text
    assert env.step(state, "Action: finish[tulsa]").reward == 1.0
    demo = env.solve(Prompt("nq", "0", "Which city?", ["The", "Tulsa"], {"context": [["T", "Tulsa is a city."]]}))
    assert demo[-1].endswith("finish[Tulsa]")


def test_a_prompt_whose_every_alias_normalises_to_nothing_is_refused_at_reset():
    env = QAEnvironment("nq", ContextBM25Retriever())
    with pytest.raises(ValueError, match=r"nq/7.*'The'"):
        env.reset(Prompt("nq", "7", "Which article?", ["The", "."]))


@needs_data
def test_real_gold_aliases_score_one_and_near_misses_zero():
    nq = load_prompts(TaskConfig(name=TaskName.NQ, files=DataFileConfig(eval_fraction=0.0, max_train=1)), "train")[0]
    assert nq.answer == ["14 December 1972 UTC", "December 1972"]
    assert qa_scores("december 1972.", nq.answer) == (1.0, 1.0)
    em, f1 = qa_scores("December 1973", nq.answer)
    assert em == 0.0 and f1 == pytest.approx(0.5)  # 1 of 2 tokens shared with "December 1972"
    bamboogle = load_prompts(TaskConfig(name=TaskName.BAMBOOGLE, files=DataFileConfig(eval_fraction=0.0)), "train")[0]
    assert qa_scores("James Madison", bamboogle.answer) == (1.0, 1.0)
    assert qa_scores("James Monroe", bamboogle.answer)[0] == 0.0
    musique = load_prompts(TaskConfig(name=TaskName.MUSIQUE, files=DataFileConfig(eval_fraction=0.0)), "train")[0]
    assert musique.answer == ["G. Stanley Hall", "Stanley Hall"]  # answer + answer_aliases
    assert qa_scores("Stanley Hall", musique.answer)[0] == 1.0
    assert qa_scores("Hall", musique.answer)[0] == 0.0


# ---- environment over the question's own paragraphs ---------------------------------------------------------

def test_context_search_finds_the_gold_paragraph_and_finish_scores(hotpot):
    prompt = hotpot[0]
    assert prompt.answer == ["Tulsa"] and len(prompt.meta["context"]) == 10
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=2, max_turns=4)
    state, message = env.reset(prompt)
    assert message.endswith(f"Question: {prompt.question}") and "top 2 passages" in message
    result = env.step(state, "Thought: who made it? Action: search[Tinted Windows band first performance]")
    assert result.observation.startswith("Doc 1 (Title: Tinted Windows (band))")
    assert result.observation.count("\nDoc ") == 1 and result.num_tool_calls == 1
    win = env.step(result.state, "Action: finish[tulsa]")
    assert win.terminated and win.reward == 1.0 and win.info["em"] == 1.0 and win.info["f1"] == 1.0
    near = env.step(result.state, "Action: finish[Tulsa, Oklahoma]")
    assert near.terminated and near.reward == 0.0 and near.info["f1"] == pytest.approx(2 / 3)
    assert win.state.data == (("search", "Tinted Windows band first performance"), ("finish", "tulsa"))


def test_queries_are_capped_and_unquoted(hotpot):
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), max_query_chars=20)
    state, _ = env.reset(hotpot[0])
    result = env.step(state, "Action: search[\"Tinted Windows " + "band " * 50 + "\"]")
    # cut to 20 characters ("Tinted Windows band "), then the trailing space dropped
    assert result.info["query_truncated"] and result.state.data[0][1] == result.info["query"] == "Tinted Windows band"


def test_a_query_with_no_indexed_word_says_so(hotpot):
    env = QAEnvironment("hotpotqa", ContextBM25Retriever())
    state, _ = env.reset(hotpot[0])
    assert env.step(state, "Action: search[the of and]").observation == "No results for 'the of and'."


@pytest.mark.parametrize("text", ["", "Thought: no idea", "Action: lookup[x]", "Action: search[]", "Action: search['']",
                                  "Action: finish[ ]",
                                  "Action: search[unclosed"])
def test_malformed_turns_give_invalid_action_observations(hotpot, text):
    env = QAEnvironment("hotpotqa", ContextBM25Retriever())
    state, _ = env.reset(hotpot[0])
    result = env.step(state, text)
    assert result.observation.startswith("Invalid action:") and not result.state.done and result.reward == 0.0


def test_turn_limit_truncates_without_searching_and_done_states_refuse_steps(hotpot):
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), max_turns=2)
    state, _ = env.reset(hotpot[0])
    state = env.step(state, "Action: search[Tinted Windows]").state
    last = env.step(state, "Action: search[Tulsa]")
    assert last.truncated and not last.terminated and last.observation == "" and last.num_tool_calls == 0
    with pytest.raises(EpisodeFinishedError):
        env.step(last.state, "Action: finish[Tulsa]")


def test_context_retriever_refuses_prompts_without_paragraphs():
    with pytest.raises(RetrieverError, match="corpus_path"):
        ContextBM25Retriever().search("x", 3, Prompt("nq", "0", "q?", ["a"]))


# ---- corpora, HTTP retrieval, construction ------------------------------------------------------------------

@needs_data
def test_load_passages_reads_every_corpus_format(tmp_path):
    twowiki = load_passages(TWOWIKI_CORPUS)
    assert len(twowiki) == 6119 and twowiki[0].title == "Teutberga"
    hotpot = load_passages(SHARED_DATA / "hotpotqa" / "hipporag_original_format" / "hotpotqa_train_corpus.json")
    assert len(hotpot) == 994 and hotpot[0].title == "Demon Dice"
    assert hotpot[0].text.startswith("Demon Dice, originally")
    musique = load_passages(SHARED_DATA / "musique" / "hipporag_original_format" / "musique_train_corpus.json")
    assert len(musique) == 1890 and musique[0].title == "Journal of Mathematical Physics"
    search_r1 = tmp_path / "wiki.jsonl"
    search_r1.write_text('{"id": "0", "contents": "\\"Tulsa\\"\\nTulsa is a city."}\n\n'
                         '{"id": "1", "contents": "\\"Oklahoma\\"\\nA state."}\n')
    assert load_passages(search_r1) == [Passage("Tulsa", "Tulsa is a city."), Passage("Oklahoma", "A state.")]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"title": "a", "text": "b"}\n{"title": \n')
    with pytest.raises(RetrieverError, match="line 2"):
        load_passages(broken)


def test_corpus_bm25_over_a_small_slice(wiki_slice):
    prompt = Prompt("2wikimultihopqa", "0", "When did Lothair Ii's mother die?", ["20 March 851"])
    titles = [p.title for p in wiki_slice.search("Ermengarde of Tours death", 3, prompt)]
    assert titles[0] == "Ermengarde of Tours" and len(titles) == 3
    env = QAEnvironment("2wikimultihopqa", wiki_slice, top_k=1)
    state, _ = env.reset(prompt)
    result = env.step(state, "Action: search[Ermengarde of Tours]")
    assert result.observation.startswith("Doc 1 (Title: Ermengarde of Tours)") and "\n" not in result.observation
    assert env.step(result.state, "Action: finish[20 March 851]").reward == 1.0


def test_http_retriever_speaks_the_search_r1_protocol(retrieval_server):
    url, requests = retrieval_server
    retriever = HttpRetriever(url)
    prompt = Prompt("nq", "0", "q?", ["a"])
    passages = retriever.search("Ermengarde died", 2, prompt)
    assert passages == [Passage("Ermengarde of Tours", "Ermengarde of Tours died on 20 March 851."),
                        Passage("Lothair II", "Lothair II was king of Lotharingia.")]
    assert requests == [("/retrieve", {"queries": ["Ermengarde died"], "topk": 2, "return_scores": True})]
    assert retriever.search("Ermengarde died", 2, prompt) == passages
    assert len(requests) == 1  # cached: replays and branches see the same passages without a new request


def test_http_retriever_failure_names_the_server():
    retriever = HttpRetriever("http://127.0.0.1:9", timeout_s=0.5, max_retries=0)
    start = time.perf_counter()
    with pytest.raises(RetrieverError, match="127.0.0.1:9/retrieve"):
        retriever.search("x", 3, Prompt("nq", "0", "q?", ["a"]))
    assert time.perf_counter() - start < 5


@needs_data
def test_make_environment_picks_the_retriever_by_precedence(retrieval_server):
    url, _ = retrieval_server
    hotpot = make_environment(TaskConfig(name=TaskName.HOTPOTQA, retrieval_top_k=4, retrieval_max_chars=90,
                                         max_turns=6), 0)
    assert isinstance(hotpot.retriever, ContextBM25Retriever)
    assert (hotpot.top_k, hotpot.max_passage_chars, hotpot.max_turns) == (4, 90, 6)
    served = make_environment(TaskConfig(name=TaskName.NQ, retriever_url=url), 0)
    assert isinstance(served.retriever, HttpRetriever) and served.retriever.url == url + "/retrieve"
    nq = TaskConfig(name=TaskName.NQ, files=DataFileConfig(max_eval=2))
    with pytest.raises(DataError, match="no context paragraphs"):
        make_environment(nq, 0, prompts=load_prompts(nq, "eval"))


@needs_checker
@needs_data
def test_qa_environments_pass_the_checker(hotpot, wiki_slice, retrieval_server):
    check_environment(make_environment(TaskConfig(name=TaskName.HOTPOTQA), 0), hotpot[:3], num_random_episodes=8)
    musique_cfg = TaskConfig(name=TaskName.MUSIQUE, files=DataFileConfig(max_eval=2))
    check_environment(make_environment(musique_cfg, 0), load_prompts(musique_cfg, "eval"), num_random_episodes=6)
    wiki_prompts = load_prompts(TaskConfig(name=TaskName.TWOWIKI, files=DataFileConfig(max_eval=2)), "eval")
    check_environment(QAEnvironment("2wikimultihopqa", wiki_slice), wiki_prompts, num_random_episodes=6)
    url, _ = retrieval_server
    nq_cfg = TaskConfig(name=TaskName.NQ, retriever_url=url, files=DataFileConfig(max_eval=2))
    check_environment(make_environment(nq_cfg, 0), load_prompts(nq_cfg, "eval"), num_random_episodes=6)


# ---- grounded demonstrations (warmup SFT) -----------------------------------------------------------------
def _play(env, prompt, actions):
    state, _ = env.reset(prompt)
    observations = []
    for action in actions:
        result = env.step(state, action)
        observations.append(result.observation)
        state = result.state
    return result, observations


def _toy(question, answer, context, support, uid="q1"):
    return Prompt("hotpotqa", uid, question, [answer], {"context": context, "support": support})


def test_a_grounded_demonstration_searches_each_supporting_title_and_finishes_on_what_it_retrieved(hotpot):
    prompt = hotpot[0]
    assert prompt.meta["support"] == ["Tinted Windows (album)", "Tinted Windows (band)"]  # supporting_facts
    # "Tulsa" is past the first 400 characters of its paragraph: with the default cut the policy never sees it
    assert QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=2, max_turns=4).solve(prompt) == []
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=2, max_turns=4, max_passage_chars=2000)
    actions = env.solve(prompt)
    assert [a.split("Action: ")[1] for a in actions] == [
        "search[Tinted Windows (album)] Observation:", "search[Tinted Windows (band)] Observation:", "finish[Tulsa]"]
    result, observations = _play(env, prompt, actions)
    assert result.reward == 1.0
    assert "(Title: Tinted Windows (album))" in observations[0] and "(Title: Tinted Windows (band))" in observations[1]
    assert "tulsa" in normalize_answer(" ".join(observations))  # the answer was in what the policy saw


def test_without_evidence_in_the_retrieved_passages_there_is_no_demonstration():
    context = [["Alpha", "Alpha is a town in Norway."], ["Beta", "Beta is a river in Peru."]]
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=2, max_turns=4)
    assert env.solve(_toy("Where does Gamma flow?", "Chile", context, ["Alpha", "Beta"])) == []
    # the answer only past the shown part of a passage is no evidence either
    long = [["Alpha", "Alpha is a town. " + "It has houses. " * 40 + "It lies in Chile."]]
    short = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=1, max_turns=3, max_passage_chars=100)
    assert short.solve(_toy("Where is Alpha?", "Chile", long, ["Alpha"], uid="q2")) == []
    # one more search of the question itself, when a turn is left, can still find it
    context = [["Alpha", "Alpha is a town."], ["Beta", "Beta is a river."], ["Gamma", "Gamma flows through Chile."]]
    actions = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=1, max_turns=4).solve(
        _toy("Where does Gamma flow?", "Chile", context, ["Alpha"], uid="q3"))
    assert [a.split("Action: ")[1] for a in actions] == [
        "search[Alpha] Observation:", "search[Where does Gamma flow?] Observation:", "finish[Chile]"]


def test_a_yes_no_answer_is_demonstrated_only_when_every_supporting_paragraph_was_retrieved():
    context = [["Alpha", "Alpha is a band from Oslo."], ["Beta", "Beta is a band from Lima."],
               ["Delta", "Delta is a choir."]]
    question = "Are Alpha and Beta both bands?"
    both = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=1, max_turns=3)
    actions = both.solve(_toy(question, "yes", context, ["Alpha", "Beta"]))
    assert actions[-1].endswith("finish[yes]") and _play(both, _toy(question, "yes", context, ["Alpha", "Beta"]),
                                                          actions)[0].reward == 1.0
    one_turn = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=1, max_turns=2)  # room for one search
    assert one_turn.solve(_toy(question, "yes", context, ["Alpha", "Beta"], uid="q4")) == []


@needs_data
def test_supporting_titles_are_read_from_each_format_and_the_stats_count_what_bm25_found():
    musique_cfg = TaskConfig(name=TaskName.MUSIQUE, files=DataFileConfig(eval_fraction=0.0, max_train=20))
    musique = load_prompts(musique_cfg, "train")
    for prompt in musique:  # the supporting paragraphs, in the order of the question's decomposition
        titles = {t for t, _ in prompt.meta["context"]}
        assert prompt.meta["support"] and set(prompt.meta["support"]) <= titles, prompt.prompt_uid
    original_cfg = TaskConfig(name=TaskName.HOTPOTQA, files=DataFileConfig(
        train_path=str(SHARED_DATA / "hotpotqa" / "hipporag_original_format" / "hotpotqa_train.json"),
        eval_fraction=0.0, max_train=5))
    assert all(len(p.meta["support"]) >= 2 for p in load_prompts(original_cfg, "train"))
    context = [["Alpha", "Alpha is in Chile."], ["Beta", "Beta is a river."], ["Gamma", "Gamma is a lake."]]
    env = QAEnvironment("hotpotqa", ContextBM25Retriever(), top_k=1, max_turns=4)
    prompts = [_toy("Where is Alpha?", "Chile", context, ["Alpha", "Beta"], uid="s1"),
               _toy("Where is Gamma?", "Peru", context, ["Gamma"], uid="s2")]
    assert env.demonstration_stats(prompts) == {
        "demos/questions": 2.0, "demos/grounded": 1.0, "demos/grounded_share": 0.5,
        "demos/support_paragraphs": 3.0, "demos/support_recall": 1.0}
