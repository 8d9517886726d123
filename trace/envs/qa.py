"""Multi-hop question answering with a search tool (ReAct / Search-R1 style).

Turn format. The user message holds these instructions and the question; each turn the policy writes a
thought and one action, and generation stops at ``Observation:``::

    Thought: I need the band of the album first.
    Action: search[Tinted Windows debut album band]
    Observation: Doc 1 (Title: Tinted Windows (band)) Tinted Windows is an American supergroup ...
    Thought: Their first performance was in Tulsa.
    Action: finish[Tulsa]

- ``search[query]``: a plain-text query (surrounding quotes dropped, cut to ``max_query_chars``
  characters). The observation lists the top-``top_k`` passages as ``Doc i (Title: t) text``, each text cut
  to ``max_passage_chars`` characters, or ``No results for 'query'.``
- ``finish[answer]``: ends the episode; reward 1.0 when the answer matches any gold alias exactly after the
  official HotpotQA normalisation (lowercase, no punctuation, no a/an/the, single spaces), else 0.0. An
  answer or alias that normalises to the empty string (``finish[.]``, the alias ``"The"``) never matches.
  ``info`` carries ``em`` and ``f1`` (the best token F1 over aliases).
- Empty turns, text without an action, unknown tools, ``search[]`` and ``finish[]`` give an
  ``Invalid action: ...`` observation and the episode goes on; the turn that reaches ``max_turns`` without
  ``finish`` truncates the episode (reward 0.0, no search run).

Retrievers (all behind ``Retriever.search(query, top_k, prompt)``):
- ``ContextBM25Retriever``: BM25 (``bm25s``) over the question's own context paragraphs
  (``prompt.meta["context"]``: HotpotQA distractor's 10, MuSiQue's 20), one small index per question, cached.
- ``CorpusBM25Retriever``: BM25 over a passage corpus shared by all questions (``load_passages``: the 2Wiki,
  MuSiQue and HotpotQA corpora here, or Search-R1's ``{"id", "contents"}`` JSON lines).
- ``HttpRetriever``: a Search-R1-compatible retrieval server: ``POST <url>/retrieve`` with
  ``{"queries": [...], "topk": k, "return_scores": true}``, answer ``{"result": [[{"document": {"contents":
  "\\"Title\\"\\ntext"}, "score": s}, ...]]}``. Results are cached per (query, k) so that replaying or
  branching from a stored state sees the same passages.

``EnvState.data`` is the tuple of ``(tool, argument)`` pairs read so far (``("invalid", message)`` for turns
without a usable action). Episode state lives only in ``EnvState``; the caches above are pure memoisation.

References:
    Yao et al., "ReAct" (arXiv 2210.03629); Jin et al., "Search-R1" (arXiv 2503.09516) for the retrieval
    server protocol and the ``Doc i (Title: ...)`` observation; Robertson & Zaragoza, "The Probabilistic
    Relevance Framework: BM25 and Beyond" (2009); Lù, "BM25S" (arXiv 2407.03618).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from trace.envs.answers import ActionError, normalize_answer, parse_action, qa_scores
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult, continue_or_truncate

OBSERVATION_MARKER = "Observation:"
SEARCH, FINISH = "search", "finish"
TOOLS = (SEARCH, FINISH)
QA_TASKS = ("hotpotqa", "musique", "2wikimultihopqa", "bamboogle", "nq")


class RetrieverError(RuntimeError):
    """A retriever could not answer (bad corpus, unreachable server); the message names the source."""


@dataclass(frozen=True)
class Passage:
    """One retrievable paragraph."""

    title: str
    text: str


class Retriever(Protocol):
    """Returns the passages most relevant to a query, best first."""

    def search(self, query: str, top_k: int, prompt: Prompt) -> list[Passage]:
        """At most ``top_k`` passages for ``query`` (``prompt`` scopes per-question retrievers)."""
        ...


# ---------------------------------------------------------------------------------------------------------
# BM25 retrieval (bm25s)
# ---------------------------------------------------------------------------------------------------------

def _passage_text(passage: Passage) -> str:
    return f"{passage.title}. {passage.text}" if passage.title else passage.text


class _BM25Index:
    """A ``bm25s`` index over passages; queries with no indexed word return nothing."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        import bm25s  # heavy-ish import, only where retrieval is used

        if not passages:
            raise RetrieverError("cannot build a BM25 index over zero passages")
        self._bm25s = bm25s
        self.passages = list(passages)
        tokens = bm25s.tokenize([_passage_text(p) for p in self.passages], stopwords="en", show_progress=False)
        self._model = bm25s.BM25()
        self._model.index(tokens, show_progress=False)

    def search(self, query: str, top_k: int) -> list[Passage]:
        query_tokens = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not query_tokens or not query_tokens[0]:
            return []
        k = min(top_k, len(self.passages))
        doc_ids, scores = self._model.retrieve(query_tokens, k=k, show_progress=False)
        return [self.passages[int(i)] for i, s in zip(doc_ids[0], scores[0]) if float(s) > 0.0]


class ContextBM25Retriever:
    """BM25 over each question's own context paragraphs (``prompt.meta["context"]``: ``[[title, text], ...]``).

    Indexes are built on first use and kept for the ``cache_size`` most recent questions.
    """

    def __init__(self, cache_size: int = 512) -> None:
        self.cache_size = int(cache_size)
        self._indexes: OrderedDict[str, _BM25Index] = OrderedDict()

    @staticmethod
    def has_context(prompt: Prompt) -> bool:
        context = prompt.meta.get("context") if isinstance(prompt.meta, dict) else None
        return isinstance(context, list) and len(context) > 0

    def search(self, query: str, top_k: int, prompt: Prompt) -> list[Passage]:
        """Top passages of the prompt's context.

        Raises:
            RetrieverError: if the prompt has no context paragraphs.
        """
        index = self._indexes.get(prompt.prompt_uid)
        if index is None:
            if not self.has_context(prompt):
                raise RetrieverError(f"prompt {prompt.prompt_uid!r} has no context paragraphs; use a corpus "
                                     "(task.files.corpus_path) or a retrieval server (task.retriever_url)")
            index = _BM25Index([Passage(str(t), str(x)) for t, x in prompt.meta["context"]])
            self._indexes[prompt.prompt_uid] = index
            while len(self._indexes) > self.cache_size:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(prompt.prompt_uid)
        return index.search(query, top_k)


class CorpusBM25Retriever:
    """BM25 over one passage corpus shared by every question."""

    def __init__(self, passages: Sequence[Passage]) -> None:
        """Index ``passages`` (about 1 s per 6,000 passages on one core).

        Raises:
            RetrieverError: on an empty corpus.
        """
        self._index = _BM25Index(passages)

    @property
    def num_passages(self) -> int:
        return len(self._index.passages)

    def search(self, query: str, top_k: int, prompt: Prompt) -> list[Passage]:
        return self._index.search(query, top_k)


class HttpRetriever:
    """Client of a Search-R1-compatible retrieval server (``POST /retrieve``); see the module docstring."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, max_retries: int = 2, cache_size: int = 100_000) -> None:
        """Args:
            url: server address; ``/retrieve`` is appended unless the URL already ends with it.
            timeout_s: seconds per request.
            max_retries: extra attempts after a failed request (1 s, 2 s, ... apart).
            cache_size: (query, k) results kept, so that replays and branches see the same passages.
        """
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple[str, int], list[Passage]] = OrderedDict()

    @staticmethod
    def _passage(item: Any) -> Passage:
        document = item.get("document", item) if isinstance(item, dict) else item
        if isinstance(document, dict):
            if "title" in document and "text" in document:
                return Passage(str(document["title"]), str(document["text"]))
            contents = str(document.get("contents", document.get("text", "")))
        else:
            contents = str(document)
        title, _, text = contents.partition("\n")
        return Passage(title.strip().strip('"'), text.strip())

    def search(self, query: str, top_k: int, prompt: Prompt) -> list[Passage]:
        """Ask the server for ``top_k`` passages.

        Raises:
            RetrieverError: when every attempt fails or the answer is not in the expected shape (names the URL).
        """
        key = (query, int(top_k))
        if key in self._cache:
            self._cache.move_to_end(key)
            return list(self._cache[key])
        body = json.dumps({"queries": [query], "topk": int(top_k), "return_scores": True}).encode("utf-8")
        last_error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"},
                                             method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = json.loads(response.read().decode("utf-8"))
                break
            except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as err:
                last_error = err
                if attempt < self.max_retries:
                    time.sleep(1.0 * (attempt + 1))
        else:
            raise RetrieverError(f"retrieval server {self.url} failed after {self.max_retries + 1} attempts: "
                                 f"{last_error!r}; check task.retriever_url and that the server is running")
        try:
            results = payload["result"][0]
            passages = [self._passage(item) for item in results][: int(top_k)]
        except (KeyError, IndexError, TypeError) as err:
            raise RetrieverError(f"retrieval server {self.url} answered in an unexpected shape ({err!r}); "
                                 "expected {'result': [[{'document': {'contents': ...}, 'score': ...}]]}") from None
        self._cache[key] = passages
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return list(passages)


# ---------------------------------------------------------------------------------------------------------
# Corpora on disk
# ---------------------------------------------------------------------------------------------------------

def _passage_from_record(record: Any, where: str) -> Passage:
    if isinstance(record, dict):
        if "contents" in record:
            return HttpRetriever._passage({"contents": record["contents"]})
        text = record.get("text", record.get("paragraph_text"))
        if text is not None:
            if isinstance(text, list):
                text = "".join(str(s) for s in text)
            return Passage(str(record.get("title", "")), str(text))
    raise RetrieverError(f"{where}: a passage needs 'title' + 'text' (or 'contents'), got {str(record)[:80]!r}")


def load_passages(path: str | Path) -> list[Passage]:
    """Read a passage corpus.

    Formats (detected from the contents): a JSON array of ``{"title", "text"}`` (2Wiki / MuSiQue corpora), a
    JSON object ``{title: [sentence, ...]}`` (HotpotQA corpus), or JSON lines of ``{"title", "text"}`` or
    Search-R1's ``{"id", "contents": "\\"Title\\"\\ntext"}``.

    Raises:
        RetrieverError: missing file, invalid JSON (names the line), or a record without text.
    """
    path = Path(path)
    if not path.is_file():
        raise RetrieverError(f"corpus file {path} not found; set task.files.corpus_path to an existing file")
    raw = path.read_text(encoding="utf-8")
    stripped = raw.lstrip()
    try:
        document = json.loads(raw) if stripped[:1] in ("[", "{") else None
    except json.JSONDecodeError:
        document = None
    passages: list[Passage] = []
    if isinstance(document, list):
        passages = [_passage_from_record(r, f"{path} item {i}") for i, r in enumerate(document)]
    elif isinstance(document, dict) and not ({"title", "text", "contents"} & set(document)):
        passages = [Passage(str(title), "".join(str(s) for s in sentences) if isinstance(sentences, list)
                            else str(sentences)) for title, sentences in document.items()]
    else:
        for line_no, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise RetrieverError(f"{path} line {line_no}: invalid JSON ({err.msg}); fix or remove the "
                                     "line") from None
            passages.append(_passage_from_record(record, f"{path} line {line_no}"))
    if not passages:
        raise RetrieverError(f"corpus file {path} holds no passages")
    return passages


# ---------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------

def _instructions(top_k: int) -> str:
    return ("Answer the question. Each turn, write \"Thought: ...\" and then one action:\n"
            f"Action: search[query] - returns the top {top_k} passages for the query\n"
            "Action: finish[answer] - gives the final answer, a short span")


def _cut(text: str, max_chars: int) -> str:
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars].rsplit(" ", 1)[0]
    return (cut or text[:max_chars]) + " ..."


def gold_aliases(answer: Any) -> list[str]:
    """The gold answers of a QA prompt that exact match can score, as a list of strings.

    A string becomes a one-item list. An alias that normalises to the empty string (``normalize_answer``:
    ``""``, ``"The"``, ``")"``, ``"---"``) is left out: it is no answer, and ``finish[.]`` would match it.

    Args:
        answer: the prompt's gold answer: a string, a list of aliases, or ``None``.

    Returns:
        The scorable aliases in their original spelling and order (empty when none is left).
    """
    if answer is None:
        return []
    aliases = answer if isinstance(answer, (list, tuple)) else [answer]
    return [str(a) for a in aliases if normalize_answer(str(a))]


class QAEnvironment:
    """Multi-hop QA with ``search`` and ``finish`` actions (see the module docstring).

    Attributes:
        name: the data source (``"hotpotqa"``, ``"musique"``, ``"2wikimultihopqa"``, ``"bamboogle"``, ``"nq"``).
        max_turns: turns after which an unfinished episode is truncated.
        observation_marker: ``"Observation:"``.
        reward_range: ``(0.0, 1.0)``: exact match, 1.0 or 0.0 (F1 is reported in ``info``, not rewarded).
        retriever: the search backend.
        top_k: passages per search.
        max_query_chars: longest query, in characters (longer ones are cut).
        max_passage_chars: longest passage text shown, in characters.
    """

    observation_marker = OBSERVATION_MARKER
    reward_range = (0.0, 1.0)

    def __init__(self, name: str, retriever: Retriever, *, max_turns: int = 5, top_k: int = 3,
                 max_query_chars: int = 200, max_passage_chars: int = 400) -> None:
        """Build the environment.

        Raises:
            ValueError: on an empty name or one with ``/``, or a limit below 1.
        """
        if not name or "/" in name:
            raise ValueError(f"name {name!r} must be a non-empty data source name without '/'")
        if min(max_turns, top_k, max_query_chars, max_passage_chars) < 1:
            raise ValueError(f"max_turns, top_k, max_query_chars, max_passage_chars must be >= 1; got {max_turns}, "
                             f"{top_k}, {max_query_chars}, {max_passage_chars}")
        self.name = name
        self.retriever = retriever
        self.max_turns = int(max_turns)
        self.top_k = int(top_k)
        self.max_query_chars = int(max_query_chars)
        self.max_passage_chars = int(max_passage_chars)

    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode: instructions, then the question.

        Raises:
            ValueError: if the prompt belongs to another data source or has no gold answer that exact match
                can score (every alias normalises to the empty string).
        """
        if prompt.data_source != self.name or not gold_aliases(prompt.answer):
            raise ValueError(f"prompt {prompt.prompt_uid!r} is not a {self.name} question with an answer "
                             f"(data_source {prompt.data_source!r}, answer {prompt.answer!r}; an alias needs a word "
                             "left after normalisation); load it with trace.data.load_prompts")
        return (EnvState(prompt=prompt, num_turns=0, done=False, data=()),
                f"{_instructions(self.top_k)}\nQuestion: {prompt.question}")

    def format_passages(self, query: str, passages: Sequence[Passage]) -> str:
        """The observation of a search: ``Doc i (Title: t) text`` lines, or a no-result line."""
        if not passages:
            return f"No results for '{query}'."
        return "\n".join(f"Doc {i} (Title: {p.title}) {_cut(p.text, self.max_passage_chars)}"
                         for i, p in enumerate(passages, start=1))

    def step(self, state: EnvState, action_text: str) -> StepResult:
        """Apply one policy turn.

        Raises:
            EpisodeFinishedError: if ``state.done``.
            RetrieverError: if the retriever fails (an unreachable server after its retries); a failed
                search is an infrastructure fault, not the policy's.
        """
        if state.done:
            raise EpisodeFinishedError(f"episode of {state.prompt.prompt_uid!r} already ended after "
                                       f"{state.num_turns} turns; reset to start a new one")
        num_turns = state.num_turns + 1
        parsed = parse_action(action_text, TOOLS, self.observation_marker)
        if isinstance(parsed, ActionError):
            return self._go_on(state, num_turns, ("invalid", parsed.message), f"Invalid action: {parsed.message}",
                               0, {"parse_error": parsed.message})
        if parsed.tool == FINISH and parsed.argument:
            golds = gold_aliases(state.prompt.answer)
            em, f1 = qa_scores(parsed.argument, golds)
            return StepResult(state=EnvState(state.prompt, num_turns, True, state.data + ((FINISH, parsed.argument),)),
                              observation="", reward=em, terminated=True, truncated=False,
                              info={"action": FINISH, "answer": parsed.argument, "em": em, "f1": f1})
        query = " ".join(parsed.argument.strip().strip("\"'").split()) if parsed.tool == SEARCH else ""
        if query:
            info: dict = {"action": SEARCH}
            if len(query) > self.max_query_chars:
                info["query_truncated"] = True
                query = query[: self.max_query_chars].rstrip()
            info["query"] = query
            if num_turns >= self.max_turns:  # the search result could not be used: no call
                return self._go_on(state, num_turns, (SEARCH, query), "", 0, info)
            passages = self.retriever.search(query, self.top_k, state.prompt)
            info["num_passages"] = len(passages)
            return self._go_on(state, num_turns, (SEARCH, query), self.format_passages(query, passages), 1, info)
        if parsed.tool in TOOLS:
            placeholder = "query" if parsed.tool == SEARCH else "answer"
            message = f"{parsed.tool} needs an argument: {parsed.tool}[{placeholder}]"
        else:
            message = f"unknown tool '{parsed.tool}'; use search[query] or finish[answer]"
        return self._go_on(state, num_turns, ("invalid", message), f"Invalid action: {message}", 0,
                           {"parse_error": message})

    def _go_on(self, state: EnvState, num_turns: int, record: tuple, observation: str, num_tool_calls: int,
               info: dict) -> StepResult:
        return continue_or_truncate(state, num_turns, state.data + (record,), observation, self.max_turns,
                                    num_tool_calls=num_tool_calls, info=info)

    def solve(self, prompt: Prompt) -> list[str]:
        """Demonstration turns: search the question (when a turn is left for it), then finish with the gold.

        Returns:
            Action texts; every turn but the last ends with `` Observation:``.
        """
        turns = []
        if self.max_turns > 1:
            query = prompt.question[: self.max_query_chars].replace("[", "(").replace("]", ")")
            turns.append(f"Thought: look it up. Action: search[{query}] {OBSERVATION_MARKER}")
        turns.append(f"Thought: that answers it. Action: finish[{gold_aliases(prompt.answer)[0]}]")
        return turns


def from_task_config(task_cfg: Any, seed: int = 0, *, root: str | Path | None = None,
                     allowed_roots: Sequence[str | Path] | None = None) -> QAEnvironment:
    """The environment of a multi-hop QA task (``trace.envs.registry``'s factory).

    The retriever is, in order of precedence: ``HttpRetriever(task.retriever_url)``; BM25 over
    ``task.files.corpus_path`` (or the task's default corpus from ``trace.data.DEFAULT_FILES`` when
    ``files.train_path`` is unset); BM25 over each question's own context paragraphs.

    Args:
        task_cfg: the ``TaskConfig`` section (``name``, ``max_turns``, ``retrieval_top_k``, ``retriever_url``,
            ``files``).
        seed: unused: retrieval is deterministic and the environment draws no random numbers.
        root: folder that relative ``task.files`` paths resolve against (default: the repository root).
        allowed_roots: folders data paths may lie under (default: ``trace.data.default_allowed_roots``).

    Raises:
        ValueError: if ``task_cfg.name`` is not a QA task.
        trace.data.DataError: a corpus path outside the allowed roots.
        RetrieverError: a missing or malformed corpus file.
    """
    from trace.data import effective_files, resolve_data_path  # trace.data imports this module

    name = str(getattr(task_cfg.name, "value", task_cfg.name))
    if name not in QA_TASKS:
        raise ValueError(f"task {name!r} is not a QA task; QA tasks are {list(QA_TASKS)}")
    corpus = effective_files(task_cfg)["corpus_path"]
    if task_cfg.retriever_url:
        retriever: Retriever = HttpRetriever(task_cfg.retriever_url)
    elif corpus:
        retriever = CorpusBM25Retriever(load_passages(resolve_data_path(corpus, repo_root=root,
                                                                        allowed_roots=allowed_roots)))
    else:
        retriever = ContextBM25Retriever()
    return QAEnvironment(name, retriever, max_turns=task_cfg.max_turns, top_k=task_cfg.retrieval_top_k)
