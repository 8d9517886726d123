"""Synthetic knowledge-graph multi-hop QA: the embedded default task a small CPU policy can learn.

The graph, the questions and every observation are generated deterministically from ``(KGQAConfig, seed)``.
Everything the policy reads or writes is whitespace-separated words from a closed vocabulary
(``KGQAEnvironment.vocabulary()``), so a word-level tokenizer (``WhitespaceSplit`` + ``WordLevel``) covers
it with no unknown token; punctuation is always its own word.

The task:
- Entities ``e0 .. e{N-1}``, relations ``r0 .. r{R-1}``. Each entity has ``facts_per_entity`` facts
  ``(subject, relation, object)`` with distinct relations and an object other than itself, so a relation
  applied to an entity has at most one answer.
- A question is a start entity and a chain of 1..3 relations that exists in the graph; the answer is the
  entity reached by applying them in turn. The user message names the outermost relation first, as in
  "capital of father of e17": the chain ``(r1, r3)`` from ``e17`` (apply ``r1``, then ``r3``) reads
  ``question : r3 of r1 of e17 ?``.
- Actions: ``search [ e17 ]`` returns the fact sheet of ``e17``; ``finish [ e42 ]`` ends the episode with
  reward 1.0 if ``e42`` is the answer, else 0.0 (exact match). The policy's text may carry other words
  before the action (they are ignored) and may end with the observation marker ``Observation:``; text
  after the first marker is discarded (a fake observation written by the policy is never read). The first
  well-formed action counts. No well-formed action gives the observation ``invalid action``; searching an
  unknown entity gives ``no result``; both let the episode go on. A turn that reaches ``max_turns``
  without ``finish`` is truncated.
- A fact sheet lists the entity's facts, ``e17 r1 e33 ;``, plus ``num_distractors`` facts about other
  entities that prefer the entity's own relations (so matching the relation alone is not enough: the
  policy must also match the subject), in an order shuffled by a hash of (seed, prompt, entity).

Difficulty grows with the hop count: a k-hop question needs k correct line selections in a row, so a
partly trained policy solves 1-hop questions far more often than 3-hop ones.

Ambiguous relations (``ambiguous_relations = k``: relations ``r0 .. r{k-1}``) add decision points whose
difficulty the question shows: in an episode whose question asks for an ambiguous relation ``r``, the fact
sheet of an entity that has ``r`` also lists ``num_lookalikes`` facts ``(other, r, object)`` of other entities
on that same relation, so only the subject tells the right line from its look-alike. The solver's
demonstrations can carry a teacher's confusion there (``demo_confusion``): at an ambiguous hop it follows a
look-alike's object with that probability and goes on from the wrong entity (finishing with the last entity
it reached when the chain breaks), so the SFT policy learns to guess at those turns and RL has a decision to
learn: the turn after such a search is where a plausible wrong action is common.

Simplifications: one fact per (entity, relation); questions are balanced across hop counts; train and
eval questions are disjoint (start, chain) pairs over one shared graph.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from trace.configuration.config import KGQAConfig
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult
from trace.envs.kgqa_solver import solve as _solve
from trace.envs.kgqa_words import (  # noqa: F401  (re-exported: the action grammar)
    DATA_SOURCE, FINISH, FIXED_WORDS, INVALID_ACTION, NO_RESULT, OBSERVATION_MARKER, SEARCH, parse_action,
    stable_seed)

Question = tuple[int, tuple[int, ...]]  # (start entity, relations in application order)


def _split_evenly(total: int, capacity: dict[int, int]) -> dict[int, int]:
    """Split ``total`` over the keys of ``capacity`` as equally as possible without exceeding any capacity.

    The remainder of an uneven split goes to the smaller keys first; a capped key's surplus is spread over
    the others. Requires ``sum(capacity.values()) >= total``.
    """
    keys = sorted(capacity)
    quota = {k: 0 for k in keys}
    remaining, open_keys = total, [k for k in keys if capacity[k] > 0]
    while remaining:
        share, extra = divmod(remaining, len(open_keys))
        for j, k in enumerate(open_keys):
            quota[k] += share + (1 if j < extra else 0)
        remaining = sum(max(0, quota[k] - capacity[k]) for k in keys)
        quota = {k: min(quota[k], capacity[k]) for k in keys}
        open_keys = [k for k in keys if quota[k] < capacity[k]]
    return quota


class KGQAEnvironment:
    """Multi-hop QA over a synthetic knowledge graph with a ``search`` tool (see the module docstring).

    Attributes:
        name: ``"kgqa"``.
        max_turns: turns after which an unfinished episode is truncated.
        observation_marker: ``"Observation:"``.
        reward_range: ``(0.0, 1.0)``: 1.0 for the answer entity, else 0.0.
        cfg: the ``KGQAConfig`` the graph and questions were generated from.
        seed: the generation seed.
    """

    name = DATA_SOURCE
    observation_marker = OBSERVATION_MARKER
    reward_range = (0.0, 1.0)

    def __init__(self, cfg: KGQAConfig, *, seed: int = 0, max_turns: int = 5) -> None:
        """Generate the graph and the train/eval questions.

        Args:
            cfg: graph and question sizes.
            seed: generation seed; the same ``(cfg, seed)`` gives the same graph, questions and observations.
            max_turns: turn limit (``TaskConfig.max_turns``); a k-hop question needs k + 1 turns.

        Raises:
            ValueError: if ``max_turns`` cannot fit the solver's ``max_hops + 1`` turns, or the graph has
                fewer distinct questions than ``num_train + num_eval + num_test``.
        """
        if max_turns < cfg.max_hops + 1:
            raise ValueError(f"max_turns={max_turns} cannot fit a {cfg.max_hops}-hop question ({cfg.max_hops} "
                             f"searches + finish); set task.max_turns >= {cfg.max_hops + 1} or lower "
                             "kgqa.max_hops")
        self.cfg = cfg
        self.seed = int(seed)
        self.max_turns = int(max_turns)
        self.entities = [f"e{i}" for i in range(cfg.num_entities)]
        self.relations = [f"r{i}" for i in range(cfg.num_relations)]
        self._entity_idx = {e: i for i, e in enumerate(self.entities)}
        self._relation_idx = {r: i for i, r in enumerate(self.relations)}
        self._object = self._build_graph()  # (N, R) int: object entity, -1 where the fact does not exist
        self._relations_of = [np.flatnonzero(row >= 0) for row in self._object]
        held_out, train_questions = self._split(self._sample_questions())
        self._prompts = {split: [self._make_prompt(split, i, q) for i, q in enumerate(questions)]
                         for split, questions in (*held_out.items(), ("train", train_questions))}

    # ---- generation -------------------------------------------------------------------------------
    def _build_graph(self) -> np.ndarray:
        cfg = self.cfg
        rng = np.random.default_rng(stable_seed(self.seed, "kgqa-graph"))
        objects = np.full((cfg.num_entities, cfg.num_relations), -1, dtype=np.int64)
        for subject in range(cfg.num_entities):
            rels = rng.choice(cfg.num_relations, size=cfg.facts_per_entity, replace=False)
            # objects drawn from the other entities: shift draws past the subject to exclude self-loops
            objs = rng.integers(0, cfg.num_entities - 1, size=cfg.facts_per_entity)
            objects[subject, rels] = objs + (objs >= subject)
        return objects

    def _hop_quotas(self, total: int) -> dict[int, int]:
        """Questions per hop count: as equal as capacity allows (capacity of k hops is N * F^k)."""
        cfg = self.cfg
        capacity = {h: cfg.num_entities * cfg.facts_per_entity ** h for h in range(cfg.min_hops, cfg.max_hops + 1)}
        if sum(capacity.values()) < total:
            raise ValueError(
                f"kgqa asks for num_train + num_eval + num_test = {total} questions but the graph has only "
                f"{sum(capacity.values())} distinct (start, chain) questions with {cfg.min_hops}..{cfg.max_hops} "
                "hops; raise kgqa.num_entities or kgqa.facts_per_entity, or lower kgqa.num_train / num_eval / num_test")
        return _split_evenly(total, capacity)

    def _sample_questions(self) -> list[Question]:
        cfg = self.cfg
        rng = np.random.default_rng(stable_seed(self.seed, "kgqa-questions"))
        out: list[Question] = []
        for hops, quota in self._hop_quotas(cfg.num_train + cfg.num_eval + cfg.num_test).items():
            capacity = cfg.num_entities * cfg.facts_per_entity ** hops
            if 2 * quota >= capacity:  # dense: enumerate every walk and draw without replacement
                walks = [(s, ()) for s in range(cfg.num_entities)]
                for _ in range(hops):
                    walks = [(s, chain + (int(r),)) for s, chain in walks
                             for r in self._relations_of[self._walk(s, chain)]]
                out.extend(walks[i] for i in sorted(rng.choice(len(walks), size=quota, replace=False)))
                continue
            seen: set[Question] = set()
            while len(seen) < quota:  # sparse: rejection-sample random walks
                start = int(rng.integers(cfg.num_entities))
                chain, node = [], start
                for _ in range(hops):
                    rels = self._relations_of[node]
                    rel = int(rels[rng.integers(len(rels))])
                    chain.append(rel)
                    node = int(self._object[node, rel])
                question = (start, tuple(chain))
                if question not in seen:
                    seen.add(question)
                    out.append(question)
        return out

    def _split(self, questions: list[Question]) -> tuple[dict[str, list[Question]], list[Question]]:
        """Hold out ``num_eval`` (dev) and then ``num_test`` (test) questions, each balanced across hop counts;
        every split in a shuffled order. With ``num_test = 0`` the draws are those of a task without a test split.

        Returns:
            ``({"eval": [...], "test": [...]}, train)``; ``"test"`` only when ``num_test > 0``.
        """
        rng = np.random.default_rng(stable_seed(self.seed, "kgqa-split"))
        by_hops: dict[int, list[Question]] = {}
        for q in questions:
            by_hops.setdefault(len(q[1]), []).append(q)
        eval_quota = _split_evenly(self.cfg.num_eval, {h: len(qs) for h, qs in by_hops.items()})
        test_quota = _split_evenly(self.cfg.num_test, {h: len(qs) - eval_quota[h] for h, qs in by_hops.items()})
        held_out: dict[str, list[Question]] = {"eval": [], "test": []}
        train_questions: list[Question] = []
        for hops in sorted(by_hops):
            group = [by_hops[hops][i] for i in rng.permutation(len(by_hops[hops]))]
            held_out["eval"] += group[:eval_quota[hops]]
            held_out["test"] += group[eval_quota[hops]:eval_quota[hops] + test_quota[hops]]
            train_questions += group[eval_quota[hops] + test_quota[hops]:]
        held_out["eval"] = [held_out["eval"][i] for i in rng.permutation(len(held_out["eval"]))]
        train_questions = [train_questions[i] for i in rng.permutation(len(train_questions))]
        held_out["test"] = [held_out["test"][i] for i in rng.permutation(len(held_out["test"]))]
        if not held_out["test"]:
            del held_out["test"]
        return held_out, train_questions

    def _walk(self, start: int, chain: Sequence[int]) -> int:
        node = start
        for rel in chain:
            node = int(self._object[node, rel])
            if node < 0:
                raise ValueError(f"relation r{rel} does not exist on the chain from e{start}")
        return node

    def _make_prompt(self, split: str, idx: int, question: Question) -> Prompt:
        start, chain = question
        path = [start]
        for rel in chain:
            path.append(int(self._object[path[-1], rel]))
        words = ["question", ":"]
        for rel in reversed(chain):
            words += [self.relations[rel], "of"]
        words += [self.entities[start], "?"]
        width = max(5, len(str(max(self.cfg.num_train, self.cfg.num_eval, self.cfg.num_test) - 1)))
        return Prompt(
            data_source=DATA_SOURCE,
            example_id=f"{split}-{idx:0{width}d}",
            question=" ".join(words),
            answer=self.entities[path[-1]],
            meta={"num_hops": len(chain), "start": self.entities[start],
                  "relations": [self.relations[r] for r in chain],
                  "path": [self.entities[e] for e in path]},
        )

    # ---- data -------------------------------------------------------------------------------------
    def prompts(self, split: Literal["train", "eval", "test"] = "train") -> list[Prompt]:
        """The generated questions of ``split``: train, eval (the dev split) and test (``kgqa.num_test > 0``) are
        disjoint (start, chain) pairs.

        Raises:
            ValueError: on an unknown split.
        """
        if split not in self._prompts:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._prompts)}")
        return list(self._prompts[split])

    def vocabulary(self) -> list[str]:
        """Every word that can occur in prompts, actions and observations, in a stable order.

        Returns:
            The fixed words (``question : of ? search finish [ ] ; invalid action no result Observation:``),
            then ``e0 .. e{N-1}``, then ``r0 .. r{R-1}``.
        """
        return list(FIXED_WORDS) + self.entities + self.relations

    def is_ambiguous(self, relation: str) -> bool:
        """Whether ``relation`` (``"r3"``) is one of the ``kgqa.ambiguous_relations`` whose sheets hold look-alikes."""
        return self._relation_idx.get(relation, self.cfg.num_relations) < self.cfg.ambiguous_relations

    def facts(self, entity: str) -> list[tuple[str, str, str]]:
        """The facts ``(subject, relation, object)`` of ``entity``, by relation id.

        Raises:
            KeyError: if ``entity`` is not an entity of the graph.
        """
        if entity not in self._entity_idx:
            raise KeyError(f"unknown entity {entity!r}; entities are e0..e{self.cfg.num_entities - 1}")
        subject = self._entity_idx[entity]
        return [(entity, self.relations[r], self.entities[int(self._object[subject, r])])
                for r in self._relations_of[subject]]

    def fact_sheet(self, prompt: Prompt, entity: str) -> str:
        """The observation of ``search [ entity ]`` within ``prompt``'s episode.

        The entity's facts plus ``num_distractors`` facts of other (distinct, randomly chosen) entities, each
        on a relation the searched entity also has where the other entity has one, shuffled with a seed
        hashed from (seed, prompt uid, entity): the same search in the same episode always reads the same.

        Returns:
            Words ``s r o ; s r o ; ...``.

        Raises:
            KeyError: if ``entity`` is not an entity of the graph.
        """
        lines = self.facts(entity)
        subject = self._entity_idx[entity]
        rng = np.random.default_rng(stable_seed(self.seed, "kgqa-sheet", prompt.prompt_uid, entity))
        num_distractors = min(self.cfg.num_distractors, self.cfg.num_entities - 1)
        others = rng.choice(self.cfg.num_entities - 1, size=num_distractors, replace=False)
        own = set(int(r) for r in self._relations_of[subject])
        for other in others:
            other = int(other) + (int(other) >= subject)
            rels = self._relations_of[other]
            shared = [int(r) for r in rels if int(r) in own]
            pool = shared if shared else [int(r) for r in rels]
            rel = pool[int(rng.integers(len(pool)))]
            lines.append((self.entities[other], self.relations[rel], self.entities[int(self._object[other, rel])]))
        lines += self._lookalikes(prompt, subject, own, rng)
        order = rng.permutation(len(lines))
        return " ".join(f"{s} {r} {o} ;" for s, r, o in (lines[i] for i in order))

    def _lookalikes(self, prompt: Prompt, subject: int, own: set[int], rng: np.random.Generator) -> list:
        """Facts of other entities on each ambiguous relation of ``prompt``'s question that ``subject`` has.

        Draws from ``rng`` only when there is such a relation, so sheets without one are unchanged.
        """
        cfg = self.cfg
        asked = {self._relation_idx[r] for r in prompt.meta.get("relations", ()) if r in self._relation_idx}
        out = []
        for rel in sorted(r for r in asked & own if r < cfg.ambiguous_relations):
            others = np.flatnonzero(self._object[:, rel] >= 0)
            others = others[others != subject]
            picks = rng.choice(len(others), size=min(cfg.num_lookalikes, len(others)), replace=False)
            out += [(self.entities[int(others[i])], self.relations[rel], self.entities[int(self._object[others[i], rel])])
                    for i in sorted(picks)]
        return out

    # ---- episodes ---------------------------------------------------------------------------------
    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode; the user message is the question.

        Raises:
            ValueError: if the prompt is not a kgqa prompt with a string answer.
        """
        if prompt.data_source != DATA_SOURCE or not isinstance(prompt.answer, str):
            raise ValueError(f"prompt {prompt.prompt_uid!r} is not a kgqa question (data_source "
                             f"{prompt.data_source!r}, answer {prompt.answer!r}); use KGQAEnvironment.prompts()")
        return EnvState(prompt=prompt, num_turns=0, done=False, data=()), prompt.question

    def step(self, state: EnvState, action_text: str) -> StepResult:
        """Apply one policy turn (see the module docstring for the action grammar).

        ``state.data`` is the tuple of parsed actions so far (``"search e17"``, ``"finish e42"``,
        ``"invalid"``).

        Raises:
            EpisodeFinishedError: if ``state.done``.
        """
        if state.done:
            raise EpisodeFinishedError(f"episode of {state.prompt.prompt_uid!r} already ended after "
                                       f"{state.num_turns} turns; reset to start a new one")
        num_turns = state.num_turns + 1
        action = parse_action(action_text, self.observation_marker)
        record = "invalid" if action is None else f"{action[0]} {action[1]}"
        history = state.data + (record,)
        if action is not None and action[0] == FINISH:
            reward = 1.0 if action[1] == state.prompt.answer else 0.0
            return StepResult(state=EnvState(state.prompt, num_turns, True, history), observation="",
                              reward=reward, terminated=True, truncated=False,
                              info={"action": FINISH, "argument": action[1]})
        info: dict = {"action": SEARCH, "argument": action[1]} if action else {"parse_error": True}
        if num_turns >= self.max_turns:
            return StepResult(state=EnvState(state.prompt, num_turns, True, history), observation="",
                              reward=0.0, terminated=False, truncated=True, info=info)
        if action is None:
            observation, num_tool_calls = INVALID_ACTION, 0
        elif action[1] in self._entity_idx:
            observation, num_tool_calls = self.fact_sheet(state.prompt, action[1]), 1
        else:
            observation, num_tool_calls = NO_RESULT, 1
        return StepResult(state=EnvState(state.prompt, num_turns, False, history), observation=observation,
                          reward=0.0, terminated=False, truncated=False, num_tool_calls=num_tool_calls, info=info)

    # ---- demonstrations ---------------------------------------------------------------------------
    def solve(self, prompt: Prompt, *, demo_noise: float = 0.0, seed: int = 0) -> list[str]:
        """The solver's action texts for ``prompt`` (``trace.envs.kgqa_solver.solve``, which documents them).

        Raises:
            ValueError: if the prompt's chain does not lead to its answer in this graph.
        """
        return _solve(self, prompt, demo_noise=demo_noise, seed=seed)
