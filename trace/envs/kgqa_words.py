"""The words of the kgqa task: its fixed vocabulary, the action grammar, and its stable hash seeds.

Shared by the environment (``trace.envs.kgqa``) and its solver (``trace.envs.kgqa_solver``).
"""

from __future__ import annotations

import hashlib

DATA_SOURCE = "kgqa"
OBSERVATION_MARKER = "Observation:"
INVALID_ACTION = "invalid action"
NO_RESULT = "no result"
SEARCH, FINISH = "search", "finish"

# words other than entities and relations, in the order vocabulary() lists them
FIXED_WORDS = ("question", ":", "of", "?", SEARCH, FINISH, "[", "]", ";", "invalid", "action", "no", "result",
                OBSERVATION_MARKER)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from a hash of ``parts`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def parse_action(text: str, marker: str = OBSERVATION_MARKER) -> tuple[str, str] | None:
    """Parse the first well-formed ``search [ X ]`` / ``finish [ X ]`` from a policy turn.

    Args:
        text: the policy's turn text; anything from the first ``marker`` on is ignored.
        marker: the observation marker.

    Returns:
        ``(tool, argument)`` with ``tool`` in ``{"search", "finish"}`` and a one-word argument, or ``None``
        when the text holds no well-formed action (empty brackets, several words in the brackets, an unknown
        tool, punctuation glued to words).
    """
    words = text.split(marker, 1)[0].split()
    for i in range(len(words) - 3):
        if words[i] in (SEARCH, FINISH) and words[i + 1] == "[" and words[i + 3] == "]":
            if words[i + 2] not in ("[", "]"):
                return words[i], words[i + 2]
    return None
