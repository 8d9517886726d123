"""Single-turn function calling: BFCL v4 AST categories and API-Bank level-1 dialogues.

Turn format (ReAct). The user message lists the available functions (name, description, each parameter's
type, whether it is required, allowed values), then these instructions and the request. Each turn the
policy writes a thought and one action; generation stops at ``Observation:``::

    Thought: Two artists, so two calls.
    Action: call[[spotify.play(artist="Taylor Swift", duration=20), spotify.play(artist="Maroon 5", duration=15)]]

- ``call[[f(a=1, b="x"), g(c=2)]]``: the calls, as a Python list of calls with keyword arguments whose values
  are literals (strings, numbers, ``True``/``False``/``None`` or JSON ``true``/``false``/``null``, lists,
  dicts). A single call may drop the outer list: ``call[f(a=1)]``. The text is parsed with ``ast`` and read
  node by node; nothing is executed. Positional arguments, ``**kwargs``, bare names, expressions and nested
  calls are refused with an explanation. A call action that parses ends the episode (single turn) and is
  scored; one that does not parse gives ``Invalid action: ...`` and the episode goes on.
- ``finish[]``: end without calling anything (the right answer for irrelevance items). Any text inside
  the brackets is ignored.

Scoring (reward 1.0 or 0.0):
- BFCL: the AST checker of the Berkeley Function Calling Leaderboard (``ast_checker.py``), reimplemented:
  function name; every required argument present; every given argument known to the function and present
  in the answer; Python types checked (``int`` accepted for ``float``; tuples read as lists); strings
  compared after BFCL's ``standardize_string`` (case, spaces and ``,./-_*^`` ignored); lists, dicts and
  lists of dicts as BFCL compares them; an answer argument may be omitted only when ``""`` is among its
  acceptable values. ``simple`` needs exactly one call; ``multiple`` one call of the right function;
  ``parallel*`` the same number of calls as the answer, matched in any order. ``irrelevance`` rewards
  ``finish[]`` (no call); ``live_relevance`` rewards any parsed call. Deviations from BFCL: parallel calls
  are matched by a full one-to-one assignment (BFCL matches greedily, which can miss a valid assignment),
  element types inside lists also accept ``int`` for ``float``, and a string that standardisation would
  erase entirely (``""``, ``"."``, ``","``) is compared as written (``comparable_string``): in BFCL the gold
  delimiter ``","`` standardises to ``""`` and so matches ``delimiter="."`` or ``delimiter=""``.
- API-Bank: exactly one call, the gold API name, the same argument names, and every value equal to the gold
  one after the same string standardisation (API-Bank's gold values are strings: ``'1'`` equals ``1`` and
  ``['a', 'b']`` equals ``"['a', 'b']"``).

References:
    Patil et al., "Gorilla" / Berkeley Function Calling Leaderboard (arXiv 2305.15334; BFCL v4 data and
    ``bfcl_eval/eval_checker/ast_eval/ast_checker.py``). Li et al., "API-Bank" (arXiv 2304.08244).

Modules: ``trace.envs.calls`` parses calls, ``trace.envs.bfcl`` and ``trace.envs.api_bank`` score them; this
module is the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from trace.envs.answers import ActionError, parse_action
from trace.envs.api_bank import API_BANK_CATEGORY, check_api_bank_calls
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult, continue_or_truncate
from trace.envs.bfcl import IRRELEVANCE_CATEGORIES, RELEVANCE_CATEGORIES, check_bfcl_calls, find_function
from trace.envs.calls import CallCheck, CallSyntaxError, FunctionCall, parse_calls, render_call
from trace.tasks import FUNCTION_CALLING, task_names

OBSERVATION_MARKER = "Observation:"
CALL, FINISH = "call", "finish"
TOOLS = (CALL, FINISH)
FC_TASKS = task_names(FUNCTION_CALLING)

INSTRUCTIONS = (
    "Write \"Thought: ...\" and then one action:\n"
    "Action: call[[name(arg=value, ...), ...]] - makes every call the request needs, at once "
    "(keyword arguments, Python literals)\n"
    "Action: finish[] - when no function fits the request"
)


def _truncate(text: str, max_chars: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= max_chars else text[: max_chars - 3].rstrip() + "..."


def render_function_doc(function: dict, max_doc_chars: int = 160) -> str:
    """A compact description of one function for the user message.

    Format: ``name: description`` then one line per parameter
    ``  param (type, required|optional[, one of: a, b]): description``; descriptions are cut to
    ``max_doc_chars`` characters.
    """
    lines = [f"{function.get('name')}: {_truncate(function.get('description', ''), max_doc_chars)}"]
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    for param, spec in (parameters.get("properties") or {}).items():
        spec = spec if isinstance(spec, dict) else {}
        kind = str(spec.get("type", "any"))
        items = spec.get("items")
        if kind in ("array", "tuple") and isinstance(items, dict) and "type" in items:
            kind = f"{kind} of {items['type']}"
        notes = [kind, "required" if param in required else "optional"]
        if isinstance(spec.get("enum"), list):
            notes.append("one of: " + ", ".join(str(v) for v in spec["enum"]))
        lines.append(f"  {param} ({', '.join(notes)}): {_truncate(spec.get('description', ''), max_doc_chars)}")
    return "\n".join(lines)


def _concrete_dict(acceptable_by_key: dict) -> dict:
    """A dict value from BFCL's ``{key: [acceptable values]}``: first acceptable per key, optional keys omitted."""
    return {key: values[0] for key, values in acceptable_by_key.items()
            if isinstance(values, list) and values and "" not in values}


def _concrete_value(acceptable: Any, spec: dict) -> Any:
    """One acceptable BFCL answer value as the value a call would pass (dicts hold lists of acceptables)."""
    kind = spec.get("type")
    items = spec.get("items") if isinstance(spec.get("items"), dict) else {}
    if kind == "dict" and isinstance(acceptable, dict):
        return _concrete_dict(acceptable)
    if kind in ("array", "tuple") and items.get("type") == "dict" and isinstance(acceptable, list):
        return [_concrete_dict(item) if isinstance(item, dict) else item for item in acceptable]
    return acceptable


class FunctionCallingEnvironment:
    """Single-turn function calling with ``call`` and ``finish`` actions (see the module docstring).

    Prompts carry ``meta["functions"]`` (BFCL-style descriptions) and ``meta["category"]`` (a BFCL category or
    ``"api_bank"``); ``answer`` is the gold calls (``[{name: {arg: [acceptable values]}}]`` for BFCL,
    ``[{name: {arg: value}}]`` for API-Bank, ``[]``/``None`` when no call is expected).

    Attributes:
        name: the data source (``"bfcl"`` or ``"api_bank"``).
        max_turns: turns after which an episode without a parsed call or ``finish`` is truncated.
        observation_marker: ``"Observation:"``.
        reward_range: ``(0.0, 1.0)``: 1.0 for a call (or no call) the checker accepts, else 0.0.
        max_call_chars: longest accepted ``call[...]`` text, in characters.
        max_doc_chars: longest description shown per function / parameter, in characters.
    """

    observation_marker = OBSERVATION_MARKER
    reward_range = (0.0, 1.0)

    def __init__(self, name: str = "bfcl", *, max_turns: int = 3, max_call_chars: int = 4000,
                 max_doc_chars: int = 160) -> None:
        """Build the environment.

        Raises:
            ValueError: on an empty name or one with ``/``, or a limit below 1.
        """
        if not name or "/" in name:
            raise ValueError(f"name {name!r} must be a non-empty data source name without '/'")
        if max_turns < 1 or max_call_chars < 1 or max_doc_chars < 8:
            raise ValueError(f"need max_turns >= 1, max_call_chars >= 1, max_doc_chars >= 8; got {max_turns}, "
                             f"{max_call_chars}, {max_doc_chars}")
        self.name = name
        self.max_turns = int(max_turns)
        self.max_call_chars = int(max_call_chars)
        self.max_doc_chars = int(max_doc_chars)

    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode: functions, instructions, then the request.

        Raises:
            ValueError: if the prompt belongs to another data source or has no function list.
        """
        functions = prompt.meta.get("functions") if isinstance(prompt.meta, dict) else None
        if prompt.data_source != self.name or not isinstance(functions, list) or not functions:
            raise ValueError(f"prompt {prompt.prompt_uid!r} is not a {self.name} item with meta['functions'] "
                             f"(data_source {prompt.data_source!r}); load it with trace.data.load_prompts")
        docs = "\n".join(render_function_doc(f, self.max_doc_chars) for f in functions)
        message = f"Functions:\n{docs}\n{INSTRUCTIONS}\nRequest:\n{prompt.question}"
        return EnvState(prompt=prompt, num_turns=0, done=False, data=()), message

    def score(self, prompt: Prompt, calls: Sequence[FunctionCall]) -> CallCheck:
        """Check ``calls`` (possibly empty: no call) against the prompt's gold answer."""
        category = str(prompt.meta.get("category", ""))
        if category == API_BANK_CATEGORY:
            return check_api_bank_calls(calls, prompt.answer or [])
        return check_bfcl_calls(calls, prompt.meta.get("functions") or [], prompt.answer, category)

    def step(self, state: EnvState, action_text: str) -> StepResult:
        """Apply one policy turn.

        Raises:
            EpisodeFinishedError: if ``state.done``.
        """
        if state.done:
            raise EpisodeFinishedError(f"episode of {state.prompt.prompt_uid!r} already ended after "
                                       f"{state.num_turns} turns; reset to start a new one")
        num_turns = state.num_turns + 1
        parsed = parse_action(action_text, TOOLS, self.observation_marker)
        if isinstance(parsed, ActionError):
            return self._go_on(state, num_turns, parsed.message)
        if parsed.tool == FINISH:
            return self._terminate(state, num_turns, [], (FINISH, parsed.argument))
        if parsed.tool == CALL:
            try:
                calls = parse_calls(parsed.argument, max_chars=self.max_call_chars)
            except CallSyntaxError as err:
                return self._go_on(state, num_turns, str(err))
            return self._terminate(state, num_turns, calls, (CALL, parsed.argument))
        return self._go_on(state, num_turns, f"unknown tool '{parsed.tool}'; use call[[name(arg=value)]] or finish[]")

    def _terminate(self, state: EnvState, num_turns: int, calls: list[FunctionCall], record: tuple) -> StepResult:
        check = self.score(state.prompt, calls)
        info = {"action": record[0], "calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
                "success": check.valid}
        if check.error:
            info["check_error"] = check.error
        return StepResult(state=EnvState(state.prompt, num_turns, True, state.data + (record,)), observation="",
                          reward=1.0 if check.valid else 0.0, terminated=True, truncated=False,
                          num_tool_calls=len(calls), info=info)

    def _go_on(self, state: EnvState, num_turns: int, message: str) -> StepResult:
        return continue_or_truncate(state, num_turns, state.data + (("invalid", message),),
                                    f"Invalid action: {message}", self.max_turns, info={"parse_error": message})

    def solve(self, prompt: Prompt) -> list[str]:
        """The gold answer as one action text (first acceptable value of each argument; optional ones omitted).

        Returns:
            ``["Thought: ... Action: call[[...]]"]``, or ``finish[]`` when no call is expected; ``[]`` (no
            demonstration) for ``live_relevance``, whose items have no gold call (any call scores).
        """
        category = str(prompt.meta.get("category", ""))
        if category in RELEVANCE_CATEGORIES:
            return []
        if category in IRRELEVANCE_CATEGORIES or not prompt.answer:
            return ["Thought: no function fits the request. Action: finish[]"]
        rendered = []
        for entry in prompt.answer:
            (name, args), = entry.items()
            if category == API_BANK_CATEGORY:
                chosen = dict(args)
            else:
                function = find_function(prompt.meta.get("functions") or [], name) or {}
                required = set((function.get("parameters") or {}).get("required") or [])
                chosen = {}
                properties = (function.get("parameters") or {}).get("properties") or {}
                for arg, acceptable in args.items():
                    values = [v for v in acceptable if v != ""]
                    if values and ("" not in acceptable or arg in required):
                        chosen[arg] = _concrete_value(values[0], properties.get(arg) or {})
            rendered.append(render_call(name, chosen))
        return [f"Thought: call the functions. Action: call[[{', '.join(rendered)}]]"]


def from_task_config(task_cfg: Any, seed: int = 0, *, root: str | Path | None = None,
                     allowed_roots: Sequence[str | Path] | None = None) -> FunctionCallingEnvironment:
    """The environment of a function-calling task (``trace.envs.registry``'s factory).

    Args:
        task_cfg: the ``TaskConfig`` section; ``name`` (bfcl or api_bank) and ``max_turns`` are used.
        seed: unused: the environment is deterministic and draws no random numbers.
        root: unused (the gold answers travel in the prompts); accepted for the registry's uniform signature.
        allowed_roots: unused, as ``root``.

    Raises:
        ValueError: if ``task_cfg.name`` is not a function-calling task.
    """
    name = str(getattr(task_cfg.name, "value", task_cfg.name))
    if name not in FC_TASKS:
        raise ValueError(f"task {name!r} is not a function-calling task; they are {list(FC_TASKS)}")
    return FunctionCallingEnvironment(name, max_turns=task_cfg.max_turns)
