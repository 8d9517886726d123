"""Function calls as data: parsing the text of a ``call[...]`` action without executing anything.

``parse_calls`` reads a Python list of calls with keyword arguments whose values are literals (strings,
numbers, ``True``/``False``/``None`` or JSON ``true``/``false``/``null``, lists, dicts) with ``ast``, node by
node; positional arguments, ``**kwargs``, bare names, expressions and nested calls are refused with an
explanation. ``render_call`` writes a call back as text that ``parse_calls`` reads to the same values.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any


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

