"""Retrievers for the search tool of multi-hop QA, all behind ``Retriever.search(query, top_k, prompt)``.

- ``ContextBM25Retriever``: BM25 (``bm25s``) over the question's own context paragraphs
  (``prompt.meta["context"]``), one small index per question, cached.
- ``CorpusBM25Retriever``: BM25 over a passage corpus shared by all questions (``load_passages``).
- ``HttpRetriever``: a Search-R1-compatible retrieval server (``POST <url>/retrieve``), results cached per
  (query, k) so that replaying or branching from a stored state sees the same passages.

The caches are pure memoisation: the same query on the same prompt always gives the same passages.

References:
    Jin et al., "Search-R1" (arXiv 2503.09516) for the retrieval server protocol; Robertson & Zaragoza, "The
    Probabilistic Relevance Framework: BM25 and Beyond" (2009); Lù, "BM25S" (arXiv 2407.03618).
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

from trace.envs.base import Prompt
from trace.errors import UserError


class RetrieverError(UserError, RuntimeError):
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
