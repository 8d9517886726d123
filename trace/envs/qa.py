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

Demonstrations (``solve``, for the warmup SFT) are grounded in what the retriever returns. A demonstration
searches, one turn per hop, the title of each of the question's supporting paragraphs
(``prompt.meta["support"]``, in the dataset's order: HotpotQA's ``supporting_facts`` titles, MuSiQue's
``is_supporting`` paragraphs in the order of its ``question_decomposition``, 2Wiki's ``supporting_facts``),
with the observation the environment's own retriever returns. It finishes with the gold answer only when
what was retrieved supports it: a gold alias occurs, as whole words after answer normalisation, in a
retrieved passage, or, for a yes/no answer (HotpotQA comparison questions), every supporting paragraph was
retrieved. A question without supporting titles (a ``qa_pairs`` file over a corpus) searches the question
itself. If the searches leave the answer unsupported, one more turn (when the turn limit leaves one)
searches the question; a question still unsupported has no demonstration (``[]``) and the warmup SFT skips
it, so the policy is never taught to answer without evidence. ``demonstration_stats`` counts how often the
retriever's top-k returned each supporting paragraph for its query and how many questions got a
demonstration.

References:
    Yao et al., "ReAct" (arXiv 2210.03629); Jin et al., "Search-R1" (arXiv 2503.09516) for the retrieval
    server protocol and the ``Doc i (Title: ...)`` observation; Robertson & Zaragoza, "The Probabilistic
    Relevance Framework: BM25 and Beyond" (2009); Lù, "BM25S" (arXiv 2407.03618).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from trace.data_paths import DEFAULT_FILES, DataError, effective_files, resolve_data_path, task_name
from trace.envs.answers import ActionError, normalize_answer, parse_action, qa_scores
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult, continue_or_truncate
from trace.envs.retrieval import (ContextBM25Retriever, CorpusBM25Retriever, HttpRetriever, Passage, Retriever,
                                  RetrieverError, load_passages)
from trace.tasks import QA, task_names

__all__ = ["OBSERVATION_MARKER", "QA_TASKS", "TOOLS", "QAEnvironment", "RetrieverError", "from_task_config",
           "gold_aliases"]

OBSERVATION_MARKER = "Observation:"
SEARCH, FINISH = "search", "finish"
TOOLS = (SEARCH, FINISH)
QA_TASKS = task_names(QA)


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


# ---- grounded demonstrations --------------------------------------------------------------------------
YES_NO = frozenset({"yes", "no"})


@dataclass(frozen=True)
class GroundedDemo:
    """A question's demonstration and what its searches retrieved.

    Attributes:
        actions: the action texts (every turn but the last ends with the observation marker); ``[]`` when the
            retrieved passages never support the gold answer.
        num_support: supporting paragraphs searched for (at most ``max_turns - 1``).
        retrieved_support: of them, how many the top-k of their own query returned.
    """

    actions: list[str]
    num_support: int
    retrieved_support: int


def supporting_titles(prompt: Prompt) -> list[str]:
    """The titles of ``prompt``'s supporting paragraphs, in hop order, each once (``meta["support"]``)."""
    titles = prompt.meta.get("support") if isinstance(prompt.meta, dict) else None
    out: list[str] = []
    for title in titles or []:
        if str(title).strip() and str(title) not in out:
            out.append(str(title))
    return out


def _query(text: str, max_chars: int) -> str:
    return " ".join(text.replace("[", "(").replace("]", ")").split())[:max_chars].rstrip()


def _supported_alias(passages: Sequence[Any], aliases: Sequence[str], support: Sequence[str],
                     retrieved_titles: set[str], max_chars: int) -> str | None:
    """The first gold alias the passages (as the observation shows them) support, or ``None``."""
    texts = [f" {normalize_answer(p.title + ' ' + _cut(p.text, max_chars))} " for p in passages]
    for alias in aliases:
        normalized = normalize_answer(alias)
        if normalized in YES_NO:
            if support and all(t in retrieved_titles for t in support):
                return alias
        elif any(f" {normalized} " in text for text in texts):
            return alias
    return None


def grounded_demo(env: Any, prompt: Prompt) -> GroundedDemo:
    """The grounded demonstration of ``prompt`` in the QA environment ``env`` (module docstring, "Demonstrations").

    Args:
        env: a ``trace.envs.qa.QAEnvironment`` (its retriever, ``top_k``, ``max_turns``, ``max_query_chars``).
        prompt: a QA prompt; ``meta["support"]`` holds its supporting titles when the dataset gives them.

    Returns:
        A ``GroundedDemo``.

    Raises:
        RetrieverError: the retriever failed.
    """
    aliases = gold_aliases(prompt.answer)
    every_support = supporting_titles(prompt)
    support = every_support[: max(env.max_turns - 1, 0)]  # a search per turn, the last turn finishes
    queries = list(support) or ([prompt.question] if env.max_turns > 1 else [])
    turns, seen, retrieved_titles, found = [], [], set(), 0
    for i, text in enumerate(queries):
        query = _query(text, env.max_query_chars)
        passages = env.retriever.search(query, env.top_k, prompt)
        seen += passages
        titles = {p.title for p in passages}
        retrieved_titles |= titles
        found += int(i < len(support) and support[i] in titles)
        turns.append(f"Thought: I need to find {query}. Action: {SEARCH}[{query}] {OBSERVATION_MARKER}")
    answer = _supported_alias(seen, aliases, every_support, retrieved_titles, env.max_passage_chars)
    if answer is None and support and len(turns) < env.max_turns - 1:
        query = _query(prompt.question, env.max_query_chars)
        seen += env.retriever.search(query, env.top_k, prompt)
        turns.append(f"Thought: I need to find {query}. Action: {SEARCH}[{query}] {OBSERVATION_MARKER}")
        answer = _supported_alias(seen, aliases, every_support, retrieved_titles, env.max_passage_chars)
    if answer is None:
        return GroundedDemo([], len(support), found)
    turns.append(f"Thought: the documents give the answer. Action: {FINISH}[{answer}]")
    return GroundedDemo(turns, len(support), found)


def demonstration_stats(env: Any, prompts: Sequence[Prompt]) -> dict[str, float]:
    """How grounded the demonstrations of ``prompts`` are.

    Returns:
        ``demos/questions``, ``demos/grounded`` (questions with a demonstration), ``demos/grounded_share``,
        ``demos/support_paragraphs`` (supporting paragraphs searched for) and ``demos/support_recall`` (the share
        of them the retriever's top-k returned for their own query; NaN when no question has supporting titles).
    """
    demos = [grounded_demo(env, p) for p in prompts]
    searched = sum(d.num_support for d in demos)
    grounded = sum(bool(d.actions) for d in demos)
    return {"demos/questions": float(len(demos)), "demos/grounded": float(grounded),
            "demos/grounded_share": grounded / len(demos) if demos else float("nan"),
            "demos/support_paragraphs": float(searched),
            "demos/support_recall": sum(d.retrieved_support for d in demos) / searched if searched else float("nan")}


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

    def check_prompts(self, prompts: Sequence[Prompt]) -> None:
        """Check that the retriever can serve ``prompts``: BM25 over each question's own context
        (``ContextBM25Retriever``) needs context paragraphs in every prompt.

        Args:
            prompts: the prompts the environment will serve.

        Raises:
            DataError: some prompts have no context paragraphs (names how many, the first, and the fix).
        """
        if not isinstance(self.retriever, ContextBM25Retriever):
            return
        missing = [p.prompt_uid for p in prompts if not ContextBM25Retriever.has_context(p)]
        if missing:
            raise DataError(f"task {self.name!r}: {len(missing)} prompts (first {missing[0]!r}) have no context "
                            "paragraphs and no corpus or retrieval server is set; set task.files.corpus_path (e.g. "
                            f"{DEFAULT_FILES['2wikimultihopqa']['corpus_path']}) or task.retriever_url")

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
        """Grounded demonstration turns (``trace.envs.qa_demos``): search each supporting paragraph, finish with
        the gold only when the retrieved passages support it.

        Returns:
            Action texts, every turn but the last ending with `` Observation:``; ``[]`` when the retriever never
            returns evidence for the answer (no demonstration: the warmup skips the question).
        """
        return grounded_demo(self, prompt).actions

    def demonstration_stats(self, prompts: Sequence[Prompt]) -> dict[str, float]:
        """Grounding of the demonstrations of ``prompts`` (``trace.envs.qa_demos.demonstration_stats``)."""
        return demonstration_stats(self, prompts)


def from_task_config(task_cfg: Any, seed: int = 0, *, root: str | Path | None = None,
                     allowed_roots: Sequence[str | Path] | None = None) -> QAEnvironment:
    """The environment of a multi-hop QA task (``trace.envs.registry``'s factory).

    The retriever is, in order of precedence: ``HttpRetriever(task.retriever_url)``; BM25 over
    ``task.files.corpus_path`` (or the task's default corpus from ``trace.data_paths.DEFAULT_FILES`` when
    ``files.train_path`` is unset); BM25 over each question's own context paragraphs.

    Args:
        task_cfg: the ``TaskConfig`` section (``name``, ``max_turns``, ``retrieval_top_k``, ``retriever_url``,
            ``files``).
        seed: unused: retrieval is deterministic and the environment draws no random numbers.
        root: folder that relative ``task.files`` paths resolve against (default: the repository root).
        allowed_roots: folders data paths may lie under (default: ``trace.data_paths.default_allowed_roots``).

    Raises:
        ValueError: if ``task_cfg.name`` is not a QA task.
        trace.data_paths.DataError: a corpus path outside the allowed roots.
        RetrieverError: a missing or malformed corpus file.
    """
    name = task_name(task_cfg)
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
    return QAEnvironment(name, retriever, max_turns=task_cfg.max_turns, top_k=task_cfg.retrieval_top_k,
                         max_passage_chars=task_cfg.retrieval_max_chars)
