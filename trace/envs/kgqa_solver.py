"""The kgqa solver: demonstrations that search each entity along a question's chain, then finish.

Used by the warmup SFT (``trace.training.warmup.demonstration_trees``) and the environment checker. Two optional
imperfections, both seeded per (seed, prompt) so a demonstration is a function of the params alone:
``demo_noise`` inserts one wrong search that the solver then corrects (the episode still succeeds), and the
task's ``kgqa.demo_confusion`` makes it follow a look-alike line at an ambiguous hop (the episode fails unless
the look-alike's object happens to be the right one): a teacher that confuses look-alike facts.
"""

from __future__ import annotations

import numpy as np

from trace.envs.base import Prompt
from trace.envs.kgqa_words import FINISH, OBSERVATION_MARKER, SEARCH, stable_seed


def _objects(env: "KGQAEnvironment", entity: str) -> dict[str, str]:
    """``relation -> object`` of ``entity``'s own facts."""
    return {rel: obj for _, rel, obj in env.facts(entity)}


def solve(env: "KGQAEnvironment", prompt: Prompt, *, demo_noise: float = 0.0, seed: int = 0) -> list[str]:
    """The solver's action texts for ``prompt``: search each entity along the chain, then finish.

    Every action but the last ends with `` Observation:`` (where generation stops for the tool).

    Args:
        env: the environment that generated ``prompt``.
        prompt: a kgqa prompt of this environment.
        demo_noise: probability in ``[0, 1]`` that the demonstration makes one wrong search (an object
            of a wrong line of the previous fact sheet, or a random entity at the first hop) and then
            corrects itself with the right search; applied only when the extra turn fits ``max_turns``.
        seed: seed of the noise and confusion decisions (hashed with the prompt uid).

    Returns:
        Action texts, e.g. ``["search [ e17 ] Observation:", "search [ e33 ] Observation:",
        "finish [ e42 ]"]``.

    Raises:
        ValueError: if the prompt's chain does not lead to its answer in this graph.
    """
    start, rels = prompt.meta.get("start"), prompt.meta.get("relations")
    if start not in env.entities or not isinstance(rels, list):
        raise ValueError(f"prompt {prompt.prompt_uid!r} has no meta start/relations of this graph")
    path = [start]
    for rel in rels:
        nxt = _objects(env, path[-1]).get(rel)
        if nxt is None:
            raise ValueError(f"prompt {prompt.prompt_uid!r}: relation {rel!r} does not hold on its chain here")
        path.append(nxt)
    if path[-1] != prompt.answer:
        raise ValueError(f"prompt {prompt.prompt_uid!r}: its chain leads to {path[-1]}, not "
                         f"its answer {prompt.answer!r}; was it generated with another seed or config?")
    rng = np.random.default_rng(stable_seed(seed, "kgqa-demo", prompt.prompt_uid))
    if env.cfg.demo_confusion > 0:
        path = confused_path(env, prompt, seed)
    searches, answer = path[:-1], path[-1]
    if demo_noise > 0 and rng.random() < demo_noise and len(searches) + 2 <= env.max_turns:
        hop = int(rng.integers(len(searches)))
        if hop == 0:
            candidates = [e for e in env.entities if e != searches[0]]
        else:
            sheet = env.fact_sheet(prompt, searches[hop - 1]).split()
            candidates = sorted({sheet[i + 2] for i in range(0, len(sheet), 4)} - {searches[hop]})
        wrong = candidates[int(rng.integers(len(candidates)))]
        searches = searches[:hop] + [wrong] + searches[hop:]
    actions = [f"{SEARCH} [ {e} ] {OBSERVATION_MARKER}" for e in searches]
    actions.append(f"{FINISH} [ {answer} ]")
    return actions


def confused_path(env: "KGQAEnvironment", prompt: Prompt, seed: int) -> list[str]:
    """The entities a confused solver visits, start first and its answer last.

    The true path, except that at a hop whose relation is ambiguous (``rN`` with ``N <
    kgqa.ambiguous_relations``) it follows a look-alike line of the fact sheet (a fact of another entity on
    that relation) with probability ``kgqa.demo_confusion``, and goes on from that entity; from an entity
    without the next relation it stops there, so the last entity it reached is its answer.

    Args:
        env: the environment that generated ``prompt``.
        prompt: a kgqa prompt whose chain holds in ``env``'s graph.
        seed: seed of the confusion draws (hashed with the prompt uid).

    Returns:
        Entity names, ``len(chain) + 1`` of them unless the chain broke early.
    """
    rng = np.random.default_rng(stable_seed(seed, "kgqa-confusion", prompt.prompt_uid))
    path = [prompt.meta["start"]]
    for rel in prompt.meta["relations"]:
        node = path[-1]
        nxt = _objects(env, node).get(rel)
        if nxt is None:
            break
        if env.is_ambiguous(rel) and rng.random() < env.cfg.demo_confusion:
            sheet = env.fact_sheet(prompt, node).split()
            looks = [sheet[i + 2] for i in range(0, len(sheet), 4) if sheet[i + 1] == rel and sheet[i] != node]
            if looks:
                nxt = looks[int(rng.integers(len(looks)))]
        path.append(nxt)
    return path
