"""API-Bank level-1: its gold call format, its API descriptions, and scoring one call against the gold.

Exactly one call, the gold API name, the same argument names, and every value equal to the gold one after
BFCL's string standardisation (API-Bank's gold values are strings: ``'1'`` equals ``1`` and ``['a', 'b']``
equals ``"['a', 'b']"``).

References:
    Li et al., "API-Bank" (arXiv 2304.08244).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from trace.envs.bfcl import comparable_string
from trace.envs.calls import CallCheck, FunctionCall

API_BANK_CATEGORY = "api_bank"


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
