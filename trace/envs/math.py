"""Math word problems with a calculator tool: GSM8K, MATH-style ``\\boxed{}`` answers, AIME / AMC.

Turn format (ReAct). The user message holds the problem and these instructions; each turn the policy writes
a thought and one action, and generation stops at ``Observation:``::

    Thought: 48 / 2 clips in May.
    Action: calculate[48 / 2]
    Observation: 24
    Thought: 48 + 24 in total.
    Action: finish[72]

- ``calculate[expression]``: arithmetic on numbers with ``+ - * / // % **`` (``^`` is read as ``**``) and
  parentheses; thousands separators (``1,234``) are allowed. The observation is the exact result (an
  integer, or a decimal with 10 significant digits) or ``Calculator error: ...``. The expression is parsed
  with ``ast`` and evaluated by walking the tree; names, attributes, calls, subscripts, comprehensions,
  lambdas and strings are refused, and so are expressions over ``max_expression_chars`` characters and any
  result (or power, estimated before it is computed) over ``max_bits`` bits, so ``9**9**9`` is refused at
  once. Model text is never passed to ``eval``.
- ``finish[answer]``: ends the episode; reward 1.0 when the answer equals the gold one
  (``answers.math_answers_match``: exact fractions for numbers, so ``1,234`` / ``1234.0`` / ``$1234`` match
  1234 and ``12345`` does not; MATH string normalisation otherwise), else 0.0. A gold with no number and
  nothing left after normalisation (``answers.is_empty_math_answer``) is refused at ``reset``.
- A turn with no ``Action:`` but a ``\\boxed{...}`` is a final answer (the box's content). An explicit
  action takes precedence over a box in the thought.
- Empty turns, unknown tools, ``calculate[]`` / ``finish[]`` with nothing inside give an
  ``Invalid action: ...`` observation and the episode goes on; the turn that reaches ``max_turns`` without a
  final answer truncates the episode (reward 0.0).

``EnvState.data`` is the tuple of ``(tool, argument)`` pairs read so far (``("invalid", message)`` for turns
without a usable action). The environment keeps no per-episode state of its own, so any stored state can be
stepped again (branching) with the same result.
"""

from __future__ import annotations

import ast
import math as _math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

from trace.envs.answers import (ActionError, extract_boxed, is_empty_math_answer, math_answers_match, parse_action,
                                parse_number)
from trace.envs.base import EnvState, EpisodeFinishedError, Prompt, StepResult, continue_or_truncate
from trace.tasks import MATH, task_names

OBSERVATION_MARKER = "Observation:"
CALCULATE, FINISH = "calculate", "finish"
TOOLS = (CALCULATE, FINISH)
MATH_TASKS = task_names(MATH)

INSTRUCTIONS = (
    "Solve the problem. Each turn, write \"Thought: ...\" and then one action:\n"
    "Action: calculate[expression] - evaluates numbers with + - * / // % ** and parentheses\n"
    "Action: finish[answer] - submits the final answer"
)


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the policy."""


_BINARY_OPERATORS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
}
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
Number = Fraction | float


def _bits(value: Fraction) -> int:
    return max(abs(value.numerator).bit_length(), value.denominator.bit_length())


def _check_size(value: Number, max_bits: int) -> Number:
    if isinstance(value, float):
        if not _math.isfinite(value):
            raise CalculatorError("result overflows (not a finite number)")
        return value
    if _bits(value) > max_bits:
        raise CalculatorError(f"result too large (over {max_bits} bits)")
    return value


def _power(base: Number, exponent: Number, max_bits: int) -> Number:
    """``base ** exponent`` with the result size estimated before computing it."""
    if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
        power = int(exponent)
        if base == 0:
            if power < 0:
                raise CalculatorError("division by zero (0 to a negative power)")
            return Fraction(1) if power == 0 else Fraction(0)
        if abs(base) == 1:  # any exponent is cheap: the result is 1 or -1
            return Fraction(1) if base == 1 or power % 2 == 0 else Fraction(-1)
        # |num|^p needs about p * bits(num) bits: refuse before computing (9**9**9 would take minutes)
        if abs(power) * _bits(base) > max_bits:
            raise CalculatorError(f"power too large (the result would exceed {max_bits} bits)")
        return base ** power
    try:
        result = float(base) ** float(exponent)
    except (OverflowError, ZeroDivisionError) as err:
        raise CalculatorError(f"power cannot be computed ({err})") from None
    if isinstance(result, complex):
        raise CalculatorError("power of a negative number to a fractional exponent is not a real number")
    return result


def _evaluate(node: ast.AST, max_bits: int) -> Number:
    """Evaluate an arithmetic syntax tree; anything but numbers and + - * / // % ** is refused."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, max_bits)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {value!r}")
        if isinstance(value, float):
            if not _math.isfinite(value):
                raise CalculatorError("number too large")
            # the shortest repr is the decimal the policy wrote: 0.1 stays exactly 1/10
            return _check_size(Fraction(repr(value)), max_bits)
        return _check_size(Fraction(value), max_bits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _evaluate(node.operand, max_bits)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY_OPERATORS:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; use + - * / // % **")
        left = _evaluate(node.left, max_bits)
        right = _evaluate(node.right, max_bits)
        try:
            if isinstance(node.op, ast.Pow):
                return _check_size(_power(left, right, max_bits), max_bits)
            if isinstance(node.op, ast.Add):
                result = left + right
            elif isinstance(node.op, ast.Sub):
                result = left - right
            elif isinstance(node.op, ast.Mult):
                result = left * right
            elif isinstance(node.op, ast.Div):
                result = left / right
            elif isinstance(node.op, ast.FloorDiv):
                result = left // right
            else:
                result = left % right
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError as err:
            raise CalculatorError(f"overflow ({err})") from None
        return _check_size(result, max_bits)
    kind = {ast.Name: "names", ast.Attribute: "attributes", ast.Call: "function calls",
            ast.Subscript: "subscripts", ast.Lambda: "lambdas", ast.ListComp: "comprehensions",
            ast.SetComp: "comprehensions", ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
            ast.Compare: "comparisons", ast.BoolOp: "boolean operators"}.get(type(node), f"{type(node).__name__} nodes")
    raise CalculatorError(f"{kind} are not allowed; use numbers, + - * / // % ** and parentheses")


def safe_calculate(expression: str, *, max_chars: int = 200, max_bits: int = 1024) -> Number:
    """Evaluate an arithmetic expression without ``eval``.

    The text is parsed with ``ast.parse(mode="eval")``; only number literals, unary ``+``/``-`` and binary
    ``+ - * / // % **`` are evaluated, exactly in rationals (``Fraction``) except a power with a fractional
    exponent, which is a float. ``^`` is read as ``**``, ``×``/``÷`` as ``*``/``/`` and ``1,234`` as 1234.

    Args:
        expression: the policy's text inside ``calculate[...]``.
        max_chars: longest accepted expression, in characters (checked before parsing).
        max_bits: largest accepted numerator / denominator of any literal or intermediate result, in bits;
            a power is refused before it is computed when ``|exponent| * bits(base)`` exceeds it.

    Returns:
        The value, a ``Fraction`` (or a ``float`` after a fractional power).

    Raises:
        CalculatorError: empty or too long text, a syntax error, a refused construct (names, attributes,
            calls, subscripts, comprehensions, lambdas, strings, comparisons), division by zero, or a result
            over ``max_bits``.
    """
    text = str(expression).strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > max_chars:
        raise CalculatorError(f"expression is {len(text)} characters; the limit is {max_chars}")
    text = text.rstrip("=").strip()
    text = _THOUSANDS_COMMA.sub("", text).replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalculatorError(f"cannot parse {text!r} ({type(err).__name__})") from None
    try:
        return _evaluate(tree, max_bits)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: Number) -> str:
    """Render a calculator result: integers in full, other values as a decimal with 10 significant digits."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    try:
        return f"{float(value):.10g}"
    except OverflowError:
        return str(value)


def gsm8k_final_answer(solution: str) -> str | None:
    """The final answer of a GSM8K worked solution: the text after the last ``####``, commas removed.

    Returns:
        The answer string (e.g. ``"72"``), or ``None`` when there is no ``####`` line or it is empty.
    """
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def gsm8k_calculations(solution: str) -> list[str]:
    """The calculator annotations ``<<48/2=24>>`` of a GSM8K solution that the calculator confirms, as
    expressions (``"48/2"``).

    An annotation is kept only when ``safe_calculate`` accepts its expression and gives the annotated result
    (exactly, or within 1e-6 relative for a float); one the calculator refuses (``<<5x=10>>``) or computes
    otherwise (a typo in the data) is left out, so a demonstration never shows a call whose observation
    contradicts its own thought.
    """
    kept = []
    for match in re.finditer(r"<<([^=<>]+)=([^<>]*)>>", solution):
        expression, annotated = match.group(1).strip(), parse_number(match.group(2))
        try:
            value = safe_calculate(expression)
        except CalculatorError:
            continue
        if annotated is not None and (value == annotated or abs(float(value) - float(annotated))
                                      <= 1e-6 * max(1.0, abs(float(annotated)))):
            kept.append(expression)
    return kept


def canonical_answer(value: Any) -> str:
    """A gold answer as a string: ``142.0`` -> ``"142"``, ``"025"`` stays ``"025"`` (compared as 25)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


class MathEnvironment:
    """Math problems with ``calculate`` and ``finish`` actions (see the module docstring).

    Attributes:
        name: the data source (``"gsm8k"``, ``"math"`` or ``"aime_amc"``).
        max_turns: turns after which an unfinished episode is truncated.
        observation_marker: ``"Observation:"``.
        reward_range: ``(0.0, 1.0)``: 1.0 for an answer equal to the gold one, else 0.0.
        max_expression_chars: longest calculator expression, in characters.
        max_bits: largest calculator number, in bits.
    """

    observation_marker = OBSERVATION_MARKER
    reward_range = (0.0, 1.0)

    def __init__(self, name: str = "gsm8k", *, max_turns: int = 5, max_expression_chars: int = 200,
                 max_bits: int = 1024) -> None:
        """Build the environment.

        Args:
            name: data source name; prompts of other sources are refused at ``reset``.
            max_turns: turn limit (``TaskConfig.max_turns``), >= 1.
            max_expression_chars: calculator input limit, >= 1.
            max_bits: calculator number size limit, >= 64.

        Raises:
            ValueError: on an empty name or a name with ``/``, or a limit out of range.
        """
        if not name or "/" in name:
            raise ValueError(f"name {name!r} must be a non-empty data source name without '/'")
        if max_turns < 1 or max_expression_chars < 1 or max_bits < 64:
            raise ValueError(f"need max_turns >= 1, max_expression_chars >= 1, max_bits >= 64; got "
                             f"{max_turns}, {max_expression_chars}, {max_bits}")
        self.name = name
        self.max_turns = int(max_turns)
        self.max_expression_chars = int(max_expression_chars)
        self.max_bits = int(max_bits)

    def reset(self, prompt: Prompt) -> tuple[EnvState, str]:
        """Start an episode; the user message is the instructions and the problem.

        Raises:
            ValueError: if the prompt belongs to another data source or has no gold answer (none, or one with
                no number and nothing left after normalisation: ``answers.is_empty_math_answer``).
        """
        if prompt.data_source != self.name or prompt.answer is None \
                or is_empty_math_answer(canonical_answer(prompt.answer)):
            raise ValueError(f"prompt {prompt.prompt_uid!r} is not a {self.name} problem with an answer "
                             f"(data_source {prompt.data_source!r}, answer {prompt.answer!r}); load it with "
                             "trace.data.load_prompts")
        return EnvState(prompt=prompt, num_turns=0, done=False, data=()), f"{INSTRUCTIONS}\nProblem: {prompt.question}"

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
            boxed = extract_boxed(action_text.split(self.observation_marker, 1)[0])
            if boxed:
                return self._finish(state, num_turns, boxed, source="boxed")
            return self._go_on(state, num_turns, (("invalid", parsed.message),), f"Invalid action: {parsed.message}",
                               0, {"parse_error": parsed.message})
        if parsed.tool == FINISH:
            if not parsed.argument:
                message = "finish needs an answer: finish[answer]"
                return self._go_on(state, num_turns, (("invalid", message),), f"Invalid action: {message}", 0,
                                   {"parse_error": message})
            return self._finish(state, num_turns, parsed.argument, source="finish")
        if parsed.tool == CALCULATE:
            if not parsed.argument:
                message = "calculate needs an expression: calculate[2 * (3 + 4)]"
                return self._go_on(state, num_turns, (("invalid", message),), f"Invalid action: {message}", 0,
                                   {"parse_error": message})
            try:
                value = safe_calculate(parsed.argument, max_chars=self.max_expression_chars, max_bits=self.max_bits)
                observation, info = format_number(value), {"action": CALCULATE}
            except CalculatorError as err:
                observation, info = f"Calculator error: {err}", {"action": CALCULATE, "calculator_error": str(err)}
            return self._go_on(state, num_turns, ((CALCULATE, parsed.argument),), observation, 1, info)
        message = f"unknown tool '{parsed.tool}'; use calculate[expression] or finish[answer]"
        return self._go_on(state, num_turns, (("invalid", message),), f"Invalid action: {message}", 0,
                           {"parse_error": message})

    def _finish(self, state: EnvState, num_turns: int, answer: str, *, source: str) -> StepResult:
        gold = canonical_answer(state.prompt.answer)
        success = math_answers_match(answer, gold)
        value = parse_number(extract_boxed(answer) or answer)
        info = {"action": FINISH, "answer": answer, "answer_source": source, "success": success,
                "parsed_answer": None if value is None else str(value)}
        return StepResult(state=EnvState(state.prompt, num_turns, True, state.data + ((FINISH, answer),)),
                          observation="", reward=1.0 if success else 0.0, terminated=True, truncated=False, info=info)

    def _go_on(self, state: EnvState, num_turns: int, record: tuple, observation: str, num_tool_calls: int,
               info: dict) -> StepResult:
        return continue_or_truncate(state, num_turns, state.data + record, observation, self.max_turns,
                                    num_tool_calls=num_tool_calls, info=info)

    def solve(self, prompt: Prompt) -> list[str]:
        """Demonstration turns: the GSM8K calculator annotations (if any, within the turn limit), then finish.

        Returns:
            Action texts; every turn but the last ends with `` Observation:``.
        """
        calculations: Sequence[str] = prompt.meta.get("calculations", ()) if isinstance(prompt.meta, dict) else ()
        turns = [f"Thought: compute {expr}. Action: calculate[{expr}] {OBSERVATION_MARKER}"
                 for expr in list(calculations)[: self.max_turns - 1]]
        turns.append(f"Thought: that is the answer. Action: finish[{canonical_answer(prompt.answer)}]")
        return turns


def from_task_config(task_cfg: Any, seed: int = 0, *, root: str | Path | None = None,
                     allowed_roots: Sequence[str | Path] | None = None) -> MathEnvironment:
    """The environment of a math task (``trace.envs.registry``'s factory).

    Args:
        task_cfg: the ``TaskConfig`` section; ``name`` (gsm8k, math or aime_amc) and ``max_turns`` are used.
        seed: unused: the environment is deterministic and draws no random numbers.
        root: unused (no files are read to build it); accepted for the registry's uniform signature.
        allowed_roots: unused, as ``root``.

    Raises:
        ValueError: if ``task_cfg.name`` is not a math task.
    """
    name = str(getattr(task_cfg.name, "value", task_cfg.name))
    if name not in MATH_TASKS:
        raise ValueError(f"task {name!r} is not a math task; math tasks are {list(MATH_TASKS)}")
    return MathEnvironment(name, max_turns=task_cfg.max_turns)
