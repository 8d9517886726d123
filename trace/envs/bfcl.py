"""The BFCL AST checker (Berkeley Function Calling Leaderboard ``ast_checker.py``), reimplemented.

Function name; every required argument present; every given argument known to the function and present in
the answer; Python types checked (``int`` accepted for ``float``; tuples read as lists); strings compared
after BFCL's ``standardize_string`` (case, spaces and ``,./-_*^`` ignored); lists, dicts and lists of dicts
as BFCL compares them; an answer argument may be omitted only when ``""`` is among its acceptable values.
``simple`` needs exactly one call; ``multiple`` one call of the right function; ``parallel*`` the same number
of calls as the answer, matched in any order. ``irrelevance`` rewards no call; ``live_relevance`` rewards any
parsed call. The deviations from BFCL are listed in ``trace.envs.fc``.

References:
    Patil et al., "Gorilla" / Berkeley Function Calling Leaderboard (arXiv 2305.15334; BFCL v4
    ``bfcl_eval/eval_checker/ast_eval/ast_checker.py``).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from trace.envs.calls import CallCheck, FunctionCall

IRRELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance")
RELEVANCE_CATEGORIES = ("live_relevance",)

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


def find_function(functions: Sequence[dict], name: str) -> dict | None:
    """The description named ``name`` among ``functions``, or ``None``."""
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
    function = find_function(functions, name)
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

