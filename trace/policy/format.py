"""ReAct conversation format: how a prompt, the policy's turns and tool observations become token ids.

A conversation is ``prompt_text + turn_1 + ... + turn_T`` where each non-final turn is the policy's generated
text followed by an *observation segment*:

    observation segment = [" " + marker, if the turn did not already end with it] + " " + observation + separator

and the final turn is the policy's text ending with EOS. Segments are cut so that every segment starts at a
pre-tokenization boundary (a space, a newline or a special token), hence

    tokenize(whole conversation text) == prompt ids + turn_1 ids + ... + turn_T ids

for the word tokenizer and for byte-level BPE chat tokenizers alike: no space or newline is lost or merged
at a turn boundary. The prompt ends with the separator (or the chat template's generation prompt), so the
policy's first token never has to carry a leading space.

Kinds:
- ``words``: the word tokenizer of ``trace.policy.tokenizer``; prompt = ``[BOS]`` + words; separator ``" "``.
- ``chat``: a pretrained chat model; prompt = ``apply_chat_template([user], add_generation_prompt=True)``;
  separator ``"\\n"``.
- ``plain``: a pretrained model without a chat template; prompt = BOS (if any) + message + ``"\\n"``.

Loss masks are never derived from padding (``ids != pad``): chat models often use EOS as the pad token and
the EOS that ends the final turn must be trained. The rollout engine builds masks from explicit lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

DEFAULT_OBSERVATION_MARKER = "Observation:"


class FormatKind(str, Enum):
    """How the prompt is rendered (see the module docstring)."""

    WORDS = "words"
    CHAT = "chat"
    PLAIN = "plain"


_DEFAULT_SEPARATORS = {FormatKind.WORDS: " ", FormatKind.CHAT: "\n", FormatKind.PLAIN: "\n"}


def _input_ids(encoded: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list or a mapping depending on the version."""
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


@dataclass(frozen=True)
class ChatFormat:
    """The policy's conversation format.

    Attributes:
        kind: ``FormatKind``.
        observation_marker: the text that opens an observation (``"Observation:"``); generation of a turn stops
            once the policy emits it, and the environment's tool output follows it.
        turn_separator: text that ends every observation segment, after which the next turn starts
            (``" "`` for words, ``"\\n"`` for chat and plain); ``None`` picks the kind's default.
        turn_prefix: context text that opens every policy turn (after the prompt and after each observation),
            e.g. ``"Thought:"`` to hold a small instruction model to the ReAct format; loss mask 0, like the
            observation. ``""`` (default) adds nothing.
    """

    kind: FormatKind = FormatKind.WORDS
    observation_marker: str = DEFAULT_OBSERVATION_MARKER
    turn_separator: str | None = None
    turn_prefix: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FormatKind(self.kind))
        if self.turn_separator is None:
            object.__setattr__(self, "turn_separator", _DEFAULT_SEPARATORS[self.kind])
        if not self.observation_marker or self.observation_marker != self.observation_marker.strip():
            raise ValueError(f"observation_marker {self.observation_marker!r} must be non-empty text without "
                             "leading or trailing whitespace (e.g. 'Observation:')")
        if self.kind == FormatKind.WORDS and any(ch.isspace() for ch in self.observation_marker):
            raise ValueError(f"observation_marker {self.observation_marker!r} must be one word for the words "
                             "format (the word tokenizer maps it to one token)")
        if not self.turn_separator or self.turn_separator.strip():
            raise ValueError(f"turn_separator {self.turn_separator!r} must be non-empty whitespace so the next turn "
                             "starts at a token boundary")
        if self.turn_prefix != self.turn_prefix.strip():
            raise ValueError(f"turn_prefix {self.turn_prefix!r} must not start or end with whitespace "
                             "(e.g. 'Thought:'); the policy's turn continues right after it")
        if self.kind == FormatKind.WORDS and self.turn_prefix:
            raise ValueError("turn_prefix is for the chat and plain formats; the words format has none")

    # ---- (de)serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable form (saved next to the policy weights)."""
        return {"kind": self.kind.value, "observation_marker": self.observation_marker,
                "turn_separator": self.turn_separator, "turn_prefix": self.turn_prefix}

    @classmethod
    def from_dict(cls, data: dict) -> "ChatFormat":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on an unknown kind or key (names the valid ones).
        """
        valid = {"kind", "observation_marker", "turn_separator", "turn_prefix"}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"unknown ChatFormat keys {sorted(unknown)}; valid keys: {sorted(valid)}")
        kind = data.get("kind", FormatKind.WORDS.value)
        if kind not in [k.value for k in FormatKind]:
            raise ValueError(f"unknown format kind {kind!r}; valid kinds: {[k.value for k in FormatKind]}")
        return cls(kind=FormatKind(kind), observation_marker=data.get("observation_marker", DEFAULT_OBSERVATION_MARKER),
                   turn_separator=data.get("turn_separator"), turn_prefix=data.get("turn_prefix", ""))

    # ---- encoding ---------------------------------------------------------------------------------------
    @staticmethod
    def encode(tokenizer: Any, text: str) -> list[int]:
        """Token ids of a text segment, no special tokens added (BOS/EOS are placed explicitly)."""
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    @staticmethod
    def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
        """Exact text of ``token_ids`` with special tokens kept (``encode(decode(ids)) == ids`` for canonical ids)."""
        return tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @staticmethod
    def action_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
        """The text of a generated turn as the environment reads it: special tokens (EOS) dropped."""
        return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def prompt_text(self, tokenizer: Any, user_message: str) -> str:
        """Exact text of the prompt tokens (ends where the policy's first turn begins).

        Raises:
            ValueError: the words kind and the tokenizer has no BOS token; the chat kind and no chat template.
        """
        if self.kind == FormatKind.WORDS:
            if tokenizer.bos_token is None:
                raise ValueError("the words format needs a tokenizer with a BOS token (build_word_tokenizer sets it)")
            return f"{tokenizer.bos_token} {user_message}{self.turn_separator}"
        if self.kind == FormatKind.CHAT:
            self._check_chat_template(tokenizer)
            return tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                                 add_generation_prompt=True, tokenize=False) + self.turn_prefix
        return f"{tokenizer.bos_token or ''}{user_message}{self.turn_separator}{self.turn_prefix}"

    def prompt_token_ids(self, tokenizer: Any, user_message: str) -> list[int]:
        """Token ids the policy is conditioned on before its first turn.

        Returns:
            words: ``[bos_id] + ids(words)``; chat: ``apply_chat_template([{"role": "user", ...}],
            add_generation_prompt=True)`` + ids(turn_prefix); plain: ``[bos_id]`` (if the tokenizer has one) +
            ids(message + "\\n" + turn_prefix).

        Raises:
            ValueError: as ``prompt_text``.
        """
        if self.kind == FormatKind.WORDS:
            if tokenizer.bos_token_id is None:
                raise ValueError("the words format needs a tokenizer with a BOS token (build_word_tokenizer sets it)")
            return [int(tokenizer.bos_token_id)] + self.encode(tokenizer, user_message)
        if self.kind == FormatKind.CHAT:
            self._check_chat_template(tokenizer)
            ids = _input_ids(tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                                           add_generation_prompt=True, tokenize=True))
            return ids + (self.encode(tokenizer, self.turn_prefix) if self.turn_prefix else [])
        bos = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
        return bos + self.encode(tokenizer, user_message + self.turn_separator + self.turn_prefix)

    def turn_text(self, action: str) -> str:
        """The part of a written turn that the policy generates: ``action`` without a leading ``turn_prefix``.

        The prefix is context (loss mask 0) that the format places before every policy turn, so what the policy
        generates, and what a demonstration must train, is the text after it. Solvers write whole ReAct turns
        (``"Thought: compute 48/2. Action: ..."``) because the words format and formats without a prefix need
        them whole; with ``turn_prefix="Thought:"`` the turn the policy writes is ``" compute 48/2. Action: ..."``.
        Without this, a demonstration reads ``Thought:Thought: ...`` and trains the second copy.

        Args:
            action: a turn's text as a solver writes it.

        Returns:
            ``action[len(turn_prefix):]`` when ``action`` starts with ``turn_prefix`` (one copy removed, the
            whitespace after it kept so the turn starts at a token boundary); ``action`` itself otherwise or
            when the format has no prefix.
        """
        if self.turn_prefix and action.startswith(self.turn_prefix):
            return action[len(self.turn_prefix):]
        return action

    def ends_with_marker(self, action_text: str) -> bool:
        """True when the policy's turn already ended with the observation marker (trailing whitespace ignored)."""
        return action_text.rstrip().endswith(self.observation_marker)

    def observation_text(self, action_text: str, observation: str) -> str:
        """The observation segment appended after a non-final turn.

        Args:
            action_text: the policy's turn text (``action_text`` of its tokens).
            observation: the environment's tool output, without the marker.

        Returns:
            ``" " + marker`` (only if ``action_text`` does not already end with it) ``+ " " + observation +
            turn_separator + turn_prefix``. Example (words): ``"search [ e17 ] Observation:"`` and ``"e17 r3 e42"`` give
            ``" e17 r3 e42 "``; ``"search [ e17 ]"`` gives ``" Observation: e17 r3 e42 "``.

        Raises:
            ValueError: if ``observation`` is empty (non-final turns always carry an observation).
        """
        if not observation:
            raise ValueError("observation is empty: a non-final turn must carry the tool's output "
                             "(the environment returned '' for a step that did not end the episode)")
        marker = "" if self.ends_with_marker(action_text) else f" {self.observation_marker}"
        return f"{marker} {observation}{self.turn_separator}{self.turn_prefix}"

    def observation_token_ids(self, tokenizer: Any, action_text: str, observation: str) -> list[int]:
        """Token ids of ``observation_text(action_text, observation)`` (loss mask 0, logprob 0 in the tree)."""
        return self.encode(tokenizer, self.observation_text(action_text, observation))

    def end_of_turn_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids appended to a teacher-forced final turn: ``[eos_id]``.

        Raises:
            ValueError: if the tokenizer has no EOS token.
        """
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; set tokenizer.eos_token before formatting turns")
        return [int(tokenizer.eos_token_id)]

    def stop_criteria(self, tokenizer: Any) -> tuple[list[int], list[str]]:
        """How a generation backend detects the end of a non-final turn.

        Returns:
            ``(stop_token_ids, stop_strings)``: the marker's id when it is a single token of the vocabulary
            (the word tokenizer), else the marker as a stop string (BPE splits it into several tokens, and
            several token sequences spell it).
        """
        ids = self.encode(tokenizer, self.observation_marker)
        if len(ids) == 1 and ids[0] != tokenizer.unk_token_id:
            return ids, []
        return [], [self.observation_marker]

    @staticmethod
    def _check_chat_template(tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat format needs a tokenizer with a chat template; use ChatFormat(kind='plain') "
                             "for a model without one")
