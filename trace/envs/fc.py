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
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from trace.envs.answers import ActionError, parse_action
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult, continue_or_truncate

OBSERVATION_MARKER = "Observation:"
CALL, FINISH = "call", "finish"
TOOLS = (CALL, FINISH)
FC_TASKS = ("bfcl", "api_bank")
IRRELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance")
RELEVANCE_CATEGORIES = ("live_relevance",)
API_BANK_CATEGORY = "api_bank"

INSTRUCTIONS = (
    "Write \"Thought: ...\" and then one action:\n"
    "Action: call[[name(arg=value, ...), ...]] - makes every call the request needs, at once "
    "(keyword arguments, Python literals)\n"
    "Action: finish[] - when no function fits the request"
)


class CallSyntaxError(ValueError):
    """The text of a ``call[...]`` action is not a list of literal keyword-argument calls."""


@dataclass(frozen=True)
class FunctionCall:
    """One parsed call: a dotted function name and its keyword arguments (plain Python values)."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CallCheck:
    """Result of matching calls against a gold answer: ``valid`` and, when not, why."""

    valid: bool
    error: str = ""


# ---------------------------------------------------------------------------------------------------------
# Parsing calls (never executed)
# ---------------------------------------------------------------------------------------------------------

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _literal(node: ast.AST, where: str) -> Any:
    """A literal value from its syntax tree node; anything computed is refused."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float, bool)):
            return node.value
        raise CallSyntaxError(f"{where}: unsupported constant {node.value!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float)) \
            and not isinstance(node.operand.value, bool):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, where) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                raise CallSyntaxError(f"{where}: '**' unpacking is not allowed in a dict")
            key_value = _literal(key, where)
            if isinstance(key_value, (list, dict)):
                raise CallSyntaxError(f"{where}: dict keys must be strings or numbers")
            out[key_value] = _literal(value, where)
        return out
    if isinstance(node, ast.Name):
        if node.id in _JSON_NAMES:
            return _JSON_NAMES[node.id]
        raise CallSyntaxError(f"{where}: bare name {node.id!r}; quote strings, e.g. \"{node.id}\"")
    if isinstance(node, ast.Starred):
        raise CallSyntaxError(f"{where}: '*' unpacking is not allowed")
    raise CallSyntaxError(f"{where}: only literal values are allowed, not {type(node).__name__} expressions")


def parse_calls(text: str, *, max_chars: int = 4000) -> list[FunctionCall]:
    """Parse the argument of ``call[...]`` into function calls without executing anything.

    Args:
        text: ``[f(a=1, b="x"), g.h(c=[1, 2])]`` or a single ``f(a=1)``.
        max_chars: longest accepted text, in characters (checked before parsing).

    Returns:
        The calls in the order written (at least one).

    Raises:
        CallSyntaxError: empty or too long text, a syntax error, an empty list, an item that is not a call,
            a function name that is not a dotted name, positional or ``**`` arguments, a repeated argument,
            or a value that is not a literal. The message says how to fix it.
    """
    text = str(text).strip()
    if not text:
        raise CallSyntaxError("no call given; write call[[name(arg=value)]] or finish[]")
    if len(text) > max_chars:
        raise CallSyntaxError(f"call text is {len(text)} characters; the limit is {max_chars}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        detail = getattr(err, "msg", None) or type(err).__name__
        raise CallSyntaxError(f"not a Python list of calls ({detail}); write call[[name(arg=value)]]") from None
    body = tree.body
    nodes = list(body.elts) if isinstance(body, (ast.List, ast.Tuple)) else [body]
    if not nodes:
        raise CallSyntaxError("empty call list; use finish[] when no function fits")
    calls = []
    for idx, node in enumerate(nodes):
        if not isinstance(node, ast.Call):
            raise CallSyntaxError(f"item {idx} is not a call; write name(arg=value)")
        name = _dotted_name(node.func)
        if name is None:
            raise CallSyntaxError(f"item {idx}: the function must be a name such as math.hypot")
        if node.args:
            raise CallSyntaxError(f"{name}: positional arguments are not allowed; write {name}(arg=value)")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise CallSyntaxError(f"{name}: '**' arguments are not allowed")
            if keyword.arg in arguments:
                raise CallSyntaxError(f"{name}: argument {keyword.arg!r} is given twice")
            arguments[keyword.arg] = _literal(keyword.value, f"{name}({keyword.arg}=...)")
        calls.append(FunctionCall(name=name, arguments=arguments))
    return calls


def render_call(name: str, arguments: dict) -> str:
    """``name(a=1, b='x')``: the call text ``parse_calls`` reads back to the same values."""
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"


# ---------------------------------------------------------------------------------------------------------
# BFCL AST checker
# ---------------------------------------------------------------------------------------------------------

_PYTHON_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
                 "dict": dict, "any": str}


def standardize_string(text: str) -> str:
    """BFCL's string standardisation: drop spaces and ``,./-_*^``, lowercase, single quotes -> double quotes."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def comparable_string(text: str) -> str:
    """The form strings are compared in: ``standardize_string``, unless it would erase the whole string.

    A string made only of spaces and ``,./-_*^`` (``""``, ``"."``, ``","``) keeps its written form (behind a
    NUL, so it never equals a standardised string): an empty or punctuation-only answer then matches only
    the same text, never a different one that standardisation would also erase. An explicit ``""`` still
    equals BFCL's optional marker ``""``.

    Args:
        text: a gold or predicted string value.

    Returns:
        The comparison key.
    """
    standardized = standardize_string(text)
    return standardized if standardized else "\x00" + text


def _standardize_items(values: list) -> list:
    return [comparable_string(v) if isinstance(v, str) else v for v in values]


def _answer_type(possible: list) -> type | None:
    for answer in possible:
        if answer != "":
            return type(answer)
    return None


def _dict_matches(value: dict, possible_dicts: list) -> str | None:
    """BFCL ``dict_checker``: one acceptable dict whose keys cover ``value`` and whose required keys it has."""
    error = f"dict value {value!r} matches no acceptable dict"
    for candidate in possible_dicts:
        if candidate == "" or not isinstance(candidate, dict):
            continue
        bad = None
        for key, item in value.items():
            if key not in candidate:
                bad = f"unexpected dict key {key!r}"
                break
            item_std = comparable_string(item) if isinstance(item, str) else item
            if item_std not in _standardize_items(list(candidate[key])):
                bad = f"invalid value {item!r} for dict key {key!r}"
                break
        if bad is None:
            for key, acceptable in candidate.items():
                if key not in value and "" not in acceptable:
                    bad = f"missing dict key {key!r}"
                    break
        if bad is None:
            return None
        error = bad
    return error


def _list_of_dicts_matches(value: list, possible_lists: list) -> str | None:
    for candidate in possible_lists:
        if not isinstance(candidate, list) or len(candidate) != len(value):
            continue
        if all(isinstance(v, dict) and _dict_matches(v, [c]) is None for v, c in zip(value, candidate)):
            return None
    return f"list of dicts {value!r} matches no acceptable list"


def _nested_types_ok(value: list, nested: type, possible: list) -> bool:
    """BFCL's one-level nested type check: some acceptable list whose element type each element has.

    An element passes when its type is the declared item type (``int`` also for ``float``) or the type of
    that acceptable list's elements (BFCL's "variable" rule); a non-list acceptable value (the optional
    marker ``""``) passes, as in BFCL.
    """
    for candidate in possible:
        if not isinstance(candidate, list):
            return True
        answer_type = _answer_type(candidate)
        if all(type(item) is nested or (nested is float and type(item) is int) or type(item) is answer_type
               for item in value):
            return True
    return False


def _check_argument(param: str, value: Any, spec: dict, possible: list) -> str | None:
    """Type and value check of one argument (BFCL ``simple_function_checker`` inner loop); None if valid."""
    type_name = spec.get("type") if isinstance(spec, dict) else None
    expected = _PYTHON_TYPES.get(type_name)
    items = spec.get("items") if isinstance(spec, dict) else None
    nested = _PYTHON_TYPES.get(items.get("type")) if type_name in ("array", "tuple") and isinstance(items, dict) \
        else None
    if type_name == "float" and type(value) is int:
        value = float(value)
    answer_type = _answer_type(possible)
    is_variable = False
    if expected is not None:
        if type(value) is expected:
            is_variable = answer_type is not None and answer_type is not expected
            if nested is not None and not _nested_types_ok(value, nested, possible):
                return f"argument {param!r}: the elements of {value!r} should be {items.get('type')}"
        elif answer_type is not None and type(value) is answer_type:
            is_variable = True
        else:
            return f"argument {param!r} should be {type_name}, got {type(value).__name__} ({value!r})"
    if not is_variable:
        if expected is dict:
            return _dict_matches(value, possible)
        if expected is list and nested is dict:
            return _list_of_dicts_matches(value, possible)
        if expected is str:
            if comparable_string(value) not in [comparable_string(p) for p in possible if isinstance(p, str)]:
                return f"argument {param!r}: {value!r} is not one of {possible!r}"
            return None
        if expected is list:
            acceptable = [_standardize_items(p) for p in possible if isinstance(p, list)]
            if _standardize_items(value) not in acceptable:
                return f"argument {param!r}: {value!r} is not one of {possible!r}"
            return None
    if value not in possible:
        return f"argument {param!r}: {value!r} is not one of {possible!r}"
    return None


def _find_function(functions: Sequence[dict], name: str) -> dict | None:
    for function in functions:
        if function.get("name") == name:
            return function
    return None


def check_bfcl_call(call: FunctionCall, functions: Sequence[dict], gold: dict) -> str | None:
    """Match one call against one gold entry ``{name: {arg: [acceptable values]}}``.

    Returns:
        ``None`` when the call matches, else the first reason it does not.

    References:
        BFCL ``ast_checker.simple_function_checker`` (arXiv 2305.15334).
    """
    (name, possible_args), = gold.items()
    if call.name != name:
        return f"called {call.name!r}, expected {name!r}"
    function = _find_function(functions, name)
    if function is None:
        return f"the answer's function {name!r} is not among the item's functions"
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    for param in parameters.get("required") or []:
        if param not in call.arguments:
            return f"missing required argument {param!r} of {name}"
    for param, value in call.arguments.items():
        if param not in properties or param not in possible_args:
            return f"unexpected argument {param!r} of {name}"
        error = _check_argument(param, value, properties[param], list(possible_args[param]))
        if error:
            return f"{name}: {error}"
    for param, acceptable in possible_args.items():
        if param not in call.arguments and "" not in acceptable:
            return f"missing argument {param!r} of {name} (the answer needs it)"
    return None


def _assign(matches: list[list[bool]]) -> list[int] | None:
    """A perfect matching gold -> call in a boolean matrix (Kuhn's augmenting paths), or None."""
    num_calls = len(matches[0]) if matches else 0
    owner = [-1] * num_calls

    def augment(gold_idx: int, seen: list[bool]) -> bool:
        for call_idx in range(num_calls):
            if matches[gold_idx][call_idx] and not seen[call_idx]:
                seen[call_idx] = True
                if owner[call_idx] < 0 or augment(owner[call_idx], seen):
                    owner[call_idx] = gold_idx
                    return True
        return False

    for gold_idx in range(len(matches)):
        if not augment(gold_idx, [False] * num_calls):
            return None
    return owner


def check_bfcl_calls(calls: Sequence[FunctionCall], functions: Sequence[dict], ground_truth: Sequence[dict] | None,
                     category: str) -> CallCheck:
    """Score a BFCL single-turn answer the way BFCL's AST checker does (see the module docstring).

    Args:
        calls: the parsed calls (empty when the policy finished without calling).
        functions: the item's function descriptions (BFCL ``function`` field).
        ground_truth: the item's ``possible_answer`` ``ground_truth`` (``[]`` / ``None`` for irrelevance and
            relevance items).
        category: BFCL test category (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``,
            ``irrelevance``, ``live_*``).

    Returns:
        ``CallCheck(valid, error)``.

    References:
        BFCL ``ast_checker.ast_checker`` and its parallel / multiple / simple checkers (arXiv 2305.15334).
    """
    if category in IRRELEVANCE_CATEGORIES:
        return CallCheck(not calls, "" if not calls else "no function should be called for this request")
    if category in RELEVANCE_CATEGORIES:
        return CallCheck(bool(calls), "" if calls else "a function call was expected")
    gold = list(ground_truth or [])
    if not calls:
        return CallCheck(False, "no call made; a call was expected")
    if len(calls) != len(gold):
        return CallCheck(False, f"made {len(calls)} calls, expected {len(gold)}")
    if "parallel" in category:
        errors = [[check_bfcl_call(call, functions, entry) for call in calls] for entry in gold]
        if _assign([[e is None for e in row] for row in errors]) is not None:
            return CallCheck(True)
        for gold_idx, row in enumerate(errors):
            if all(e is not None for e in row):
                (name, _), = gold[gold_idx].items()
                same_name = [e for c, e in zip(calls, row) if c.name == name]
                return CallCheck(False, f"no call matches answer {gold_idx} ({name}): "
                                        f"{same_name[0] if same_name else 'no call of that function'}")
        return CallCheck(False, "the calls cannot be matched one-to-one with the answer")
    error = check_bfcl_call(calls[0], functions, gold[0])
    return CallCheck(error is None, error or "")


# ---------------------------------------------------------------------------------------------------------
# API-Bank
# ---------------------------------------------------------------------------------------------------------

def _api_bank_canonical(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = value if isinstance(value, str) else repr(value)
    return comparable_string(text)


def check_api_bank_calls(calls: Sequence[FunctionCall], ground_truth: Sequence[dict]) -> CallCheck:
    """Score an API-Bank level-1 answer: one call, the gold name, the same argument names and values.

    Values are compared as standardised strings (``comparable_string`` of the value, or of its ``repr``
    when it is not a string), since API-Bank's gold values are the strings of ``API-Request: [...]``.

    Args:
        calls: parsed calls.
        ground_truth: ``[{api_name: {arg: value}}]`` (one entry).

    Returns:
        ``CallCheck(valid, error)``.
    """
    if len(ground_truth) != 1:
        return CallCheck(False, f"API-Bank answers hold one call, got {len(ground_truth)}")
    if len(calls) != 1:
        return CallCheck(False, f"made {len(calls)} calls, expected 1")
    (name, gold_args), = ground_truth[0].items()
    call = calls[0]
    if call.name != name:
        return CallCheck(False, f"called {call.name!r}, expected {name!r}")
    missing = sorted(set(gold_args) - set(call.arguments))
    extra = sorted(set(call.arguments) - set(gold_args))
    if missing or extra:
        return CallCheck(False, f"arguments differ: missing {missing}, unexpected {extra}")
    for key, gold_value in gold_args.items():
        if _api_bank_canonical(call.arguments[key]) != _api_bank_canonical(gold_value):
            return CallCheck(False, f"argument {key!r}: {call.arguments[key]!r} != {gold_value!r}")
    return CallCheck(True)


def parse_api_bank_request(text: str) -> FunctionCall | None:
    """Read API-Bank's own ``[ApiName(key1='value1', key2='value2')]`` gold format, quotes inside values included.

    API-Bank writes every value as ``'...'`` without escaping, e.g. ``attendees='['John', 'Jane']'``, which
    is not Python; each value here runs to the next ``, key='`` or to the closing ``)``. Values stay strings.

    Returns:
        The call, or ``None`` when the text is not in that format.
    """
    match = re.fullmatch(r"\s*\[\s*([A-Za-z_][\w.]*)\((.*)\)\s*\]\s*", text, re.S)
    if match is None:
        return None
    body = match.group(2).strip()
    pairs = re.findall(r"(\w+)\s*=\s*'(.*?)'(?=\s*,\s*\w+\s*=\s*'|\s*$)", body, re.S)
    rebuilt = ", ".join(f"{key}='{value}'" for key, value in pairs)
    if re.sub(r"\s", "", rebuilt) != re.sub(r"\s", "", body) or len({k for k, _ in pairs}) != len(pairs):
        return None
    return FunctionCall(match.group(1), dict(pairs))


def api_bank_function(description: dict) -> dict:
    """An API-Bank API description as a BFCL-style function description (every input listed as required).

    Args:
        description: ``{"name", "description", "input_parameters": {arg: {"type", "description"}}, ...}``.

    Returns:
        ``{"name", "description", "parameters": {"type": "dict", "properties", "required"}}``.
    """
    inputs = description.get("input_parameters") or {}
    return {"name": description["name"], "description": description.get("description", ""),
            "parameters": {"type": "dict",
                           "properties": {k: {"type": str(v.get("type", "str")),
                                              "description": v.get("description", "")} for k, v in inputs.items()},
                           "required": list(inputs)}}


def parse_api_bank_descriptions(instruction: str) -> list[dict]:
    """The API descriptions (one JSON object per line after ``API descriptions:``) of an API-Bank prompt."""
    import json

    if "API descriptions:" not in instruction:
        return []
    out = []
    for line in instruction.split("API descriptions:", 1)[1].splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and "name" in item:
                out.append(item)
    return out


# ---------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------

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
            ``["Thought: ... Action: call[[...]]"]``, or ``finish[]`` when no call is expected.
        """
        category = str(prompt.meta.get("category", ""))
        if category in IRRELEVANCE_CATEGORIES or category in RELEVANCE_CATEGORIES or not prompt.answer:
            return ["Thought: no function fits the request. Action: finish[]"]
        rendered = []
        for entry in prompt.answer:
            (name, args), = entry.items()
            if category == API_BANK_CATEGORY:
                chosen = dict(args)
            else:
                function = _find_function(prompt.meta.get("functions") or [], name) or {}
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
