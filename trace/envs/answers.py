"""Reading the policy's ReAct text and scoring its answers, shared by the QA, math and function-calling tasks.

Three jobs, all pure functions of strings:

- ReAct actions. A policy turn reads ``Thought: ... Action: tool[argument]``. ``parse_action`` keeps the text
  before the first observation marker (a fake observation written by the policy is never read), takes the
  first ``Action:`` label (or, without one, the first ``known_tool[``), and returns the tool name and the
  argument between the matching brackets. Anything it cannot read becomes an ``ActionError`` whose message
  the environment shows to the policy as ``Invalid action: ...``; nothing here raises on model text.
- Short answers (multi-hop QA). The official HotpotQA / SQuAD normalisation (lowercase, drop punctuation,
  drop the articles a/an/the, collapse whitespace), exact match against every alias, and token F1 with
  HotpotQA's yes/no/noanswer rule.
- Math answers. ``\\boxed{}`` extraction with brace matching, numbers written as ``1,234``, ``1234.0``,
  ``$1234``, ``\\frac{a}{b}`` or ``a/b`` parsed exactly as fractions, and a string normalisation after
  Hendrycks et al.'s MATH ``strip_string`` for everything that is not a number.

References:
    Yang et al., "HotpotQA" (arXiv 1809.09600), official ``hotpot_evaluate_v1.py`` (normalize_answer, f1).
    Rajpurkar et al., "SQuAD" (arXiv 1606.05250), the normalisation HotpotQA reuses.
    Hendrycks et al., "Measuring Mathematical Problem Solving With the MATH Dataset" (arXiv 2103.03874),
    ``is_equiv`` / ``strip_string``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

# ---------------------------------------------------------------------------------------------------------
# ReAct actions
# ---------------------------------------------------------------------------------------------------------

_ACTION_LABEL = re.compile(r"action\s*:", re.IGNORECASE)
_TOOL_AT_START = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\[")


@dataclass(frozen=True)
class ParsedAction:
    """A well-formed ``tool[argument]`` read from a turn.

    Attributes:
        tool: the tool name, lowercased (``"search"``, ``"finish"``, ``"calculate"``, ``"call"``).
        argument: the text between the brackets, stripped (may be empty; the environment decides).
    """

    tool: str
    argument: str


@dataclass(frozen=True)
class ActionError:
    """Why a turn holds no usable action; ``message`` is shown to the policy after ``Invalid action:``."""

    message: str


def strip_after_marker(text: str, marker: str) -> str:
    """Return ``text`` up to (not including) the first ``marker``; the whole text if there is none."""
    if not marker:
        return text
    cut = text.find(marker)
    return text if cut < 0 else text[:cut]


def _closing_bracket(text: str, open_idx: int, quote_aware: bool) -> int:
    """Index of the ``]`` that closes the ``[`` at ``open_idx``, or -1.

    With ``quote_aware`` brackets inside ``'...'`` / ``"..."`` (backslash escapes honoured) do not count.
    """
    depth = 0
    quote = ""
    idx = open_idx
    while idx < len(text):
        ch = text[idx]
        if quote:
            if ch == "\\":
                idx += 2
                continue
            if ch == quote:
                quote = ""
        elif quote_aware and ch in "'\"":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                return idx
        idx += 1
    return -1


def parse_action(text: str, tools: Sequence[str], marker: str = "Observation:") -> ParsedAction | ActionError:
    """Read the action of one ReAct turn.

    Rules, in order: cut the text at the first ``marker``; use the first ``Action:`` label (any case) and
    the ``name[`` right after it; without a label (or with prose after it), use the first ``tool[`` whose
    name is in ``tools``. The
    argument runs to the matching ``]`` (brackets inside quotes do not count; if quotes are unbalanced, as in
    ``finish[Ender's Game]``, plain bracket depth is used; failing that, the last ``]``). Text after the
    closing bracket is ignored.

    Args:
        text: the policy's turn text (thought and action, possibly ending with ``marker``).
        tools: the environment's tool names (lowercase).
        marker: the observation marker; it and everything after it are ignored.

    Returns:
        ``ParsedAction`` (tool lowercased; the tool may be unknown only when an ``Action:`` label named it,
        which the caller reports) or ``ActionError`` explaining what is missing.
    """
    body = strip_after_marker(text, marker)
    if not body.strip():
        return ActionError("empty turn; end the turn with 'Action: tool[argument]'")
    names = "|".join(re.escape(t) for t in sorted(tools, key=len, reverse=True))
    known_tool = re.compile(rf"(?<![\w.])({names})\s*\[", re.IGNORECASE) if names else None
    label = _ACTION_LABEL.search(body)
    segment = body if label is None else body[label.end():]
    match = _TOOL_AT_START.match(segment) if label is not None else None
    if match is None:  # no label, or prose after it ("Action: I will search[x]"): the first known tool
        match = known_tool.search(segment) if known_tool is not None else None
    if match is None:
        if label is not None:
            return ActionError("no 'tool[argument]' after 'Action:'; write e.g. "
                               f"'Action: {tools[0] if tools else 'tool'}[...]'")
        return ActionError("no action found; end the turn with 'Action: tool[argument]' using one of: "
                           + ", ".join(tools))
    tool, open_idx = match.group(1), match.end() - 1
    close_idx = _closing_bracket(segment, open_idx, quote_aware=True)
    if close_idx < 0:
        close_idx = _closing_bracket(segment, open_idx, quote_aware=False)
    if close_idx < 0:
        close_idx = segment.rfind("]")
    if close_idx <= open_idx:
        return ActionError(f"missing closing ']' after '{tool}['")
    return ParsedAction(tool=tool.lower(), argument=segment[open_idx + 1:close_idx].strip())


# ---------------------------------------------------------------------------------------------------------
# Short answers (HotpotQA / SQuAD normalisation)
# ---------------------------------------------------------------------------------------------------------

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Official HotpotQA answer normalisation: lowercase, drop punctuation, drop a/an/the, collapse spaces.

    The order is the official one: ``white_space_fix(remove_articles(remove_punc(lower(s))))``.

    References:
        HotpotQA ``hotpot_evaluate_v1.normalize_answer`` (arXiv 1809.09600), from SQuAD v1.1.
    """
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def answer_f1(prediction: str, gold: str) -> float:
    """Token F1 between normalised answers, with HotpotQA's rule for yes / no / noanswer.

    If either side normalises to ``yes``, ``no`` or ``noanswer`` and the two differ, F1 is 0.

    Returns:
        F1 in ``[0, 1]``.

    References:
        HotpotQA ``hotpot_evaluate_v1.f1_score`` (arXiv 1809.09600).
    """
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    special = ("yes", "no", "noanswer")
    if (pred in special or ref in special) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = Counter(pred_tokens) & Counter(ref_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_scores(prediction: str, golds: Sequence[str]) -> tuple[float, float]:
    """Exact match and F1 of ``prediction`` against the best of ``golds`` (every alias).

    An alias that normalises to the empty string (``""``, ``"The"``, ``"---"``) is no answer and is skipped,
    and a prediction that normalises to the empty string (``""``, ``"a"``, ``"."``) scores 0: otherwise
    ``finish[.]`` would exactly match the gold ``"The"``.

    Args:
        prediction: the policy's answer text.
        golds: the gold aliases.

    Returns:
        ``(em, f1)``: ``em`` is 1.0 when the normalised prediction equals some non-empty normalised alias,
        else 0.0; ``f1`` is the maximum token F1 over those aliases. Both 0.0 when no alias is left or the
        prediction normalises to the empty string.
    """
    pred = normalize_answer(prediction)
    scorable = [g for g in golds if normalize_answer(g)]
    if not scorable or not pred:
        return 0.0, 0.0
    em = 1.0 if any(pred == normalize_answer(g) for g in scorable) else 0.0
    f1 = max(answer_f1(prediction, g) for g in scorable)
    return em, f1


# ---------------------------------------------------------------------------------------------------------
# Math answers
# ---------------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_SLASH_FRACTION = re.compile(r"^([+-]?)(\d+)\s*/\s*(\d+)$")
_LATEX_FRACTION = re.compile(r"^([+-]?)\\frac\{([+-]?\d+(?:\.\d+)?)\}\{([+-]?\d+(?:\.\d+)?)\}$")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched.

    Also reads the brace-less form ``\\boxed 5`` (one token). Returns ``None`` when there is no complete box.
    """
    found = None
    for match in _BOXED.finditer(text):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for idx in range(start, len(text)):
                if text[idx] == "{":
                    depth += 1
                elif text[idx] == "}":
                    depth -= 1
                    if depth == 0:
                        found = text[start + 1:idx]
                        break
        else:
            token = re.match(r"[^\s$}]+", text[start:])
            if token:
                found = token.group(0)
    return None if found is None else found.strip()


def _strip_units_and_wrappers(text: str) -> str:
    """Remove what never changes a math answer's value: $, \\$, \\%, %, \\left/\\right, \\!, units, ``x =``."""
    text = text.strip().replace("\n", " ")
    text = text.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "")
    text = text.replace("\\%", "").replace("%", "")
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{\s*([^{}]*)\}", r"\1", text)
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    # "x = 5" or "k=5" -> "5" (a short left-hand side only, as MATH's strip_string does)
    parts = text.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        text = parts[1]
    text = text.strip().rstrip(".").strip()
    # trailing words (units such as "dollars", "cm", "apples") after a number
    unit = re.match(r"^([+-]?[\d,]*\.?\d+)\s+[A-Za-z][A-Za-z\s]*$", text)
    if unit:
        text = unit.group(1)
    return text.strip()


def parse_number(text: str) -> Fraction | None:
    """Parse an answer written as a number, exactly.

    Accepts ``1234``, ``-3``, ``1,234`` (thousands groups of three digits only), ``1234.0``, ``.5``,
    ``$1234``, ``1234%`` (the sign is dropped, as graders do), ``12 dollars``, ``x = 5``, ``3/4`` and
    ``\\frac{3}{4}``. Commas that are not thousands separators (``1,2``: a tuple) give ``None``.

    Returns:
        The value as a ``Fraction``, or ``None`` when the text is not a single number.
    """
    text = _strip_units_and_wrappers(str(text))
    if not text:
        return None
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _PLAIN_NUMBER.match(text):
        return Fraction(text)
    for pattern in (_SLASH_FRACTION, _LATEX_FRACTION):
        match = pattern.match(text)
        if match:
            sign, num, den = match.groups()
            if Fraction(den) == 0:
                return None
            value = Fraction(num) / Fraction(den)
            return -value if sign == "-" else value
    return None


def _fix_fracs(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}`` (MATH ``_fix_fracs``)."""
    out = []
    pieces = text.split("\\frac")
    out.append(pieces[0])
    for piece in pieces[1:]:
        out.append("\\frac")
        if piece.startswith("{") or len(piece) < 2:
            out.append(piece)
            continue
        a, rest = piece[0], piece[1:]
        if rest.startswith("{"):
            out.append("{" + a + "}" + rest)
        else:
            out.append("{" + a + "}{" + rest[0] + "}" + rest[1:])
    return "".join(out)


def normalize_math_answer(text: str) -> str:
    """A canonical string for a non-numeric math answer (MATH ``strip_string``, slightly extended).

    Drops wrappers and units (see ``parse_number``), spaces, ``\\left``/``\\right``; rewrites ``\\dfrac`` and
    ``\\tfrac`` as ``\\frac``, ``\\frac12`` as ``\\frac{1}{2}``, ``\\sqrt3`` as ``\\sqrt{3}``, and a leading
    ``.5`` as ``0.5``.

    References:
        Hendrycks et al. (arXiv 2103.03874), ``math_equivalence.strip_string``.
    """
    text = _strip_units_and_wrappers(str(text))
    text = text.replace("\\\\", "\\")
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    text = text.replace(" ", "")
    return _fix_fracs(text)


def is_empty_math_answer(text: str | None) -> bool:
    """Whether a math answer holds nothing to compare: no number and an empty ``normalize_math_answer``.

    ``""``, ``"$"``, ``"x ="``, ``"\\text{}"`` and ``"."`` are empty; ``"0"``, ``"x"`` and ``"\\frac{1}{2}"`` are
    not. ``math_answers_match`` never matches an empty gold; loaders refuse such golds.

    Args:
        text: an answer string (``None`` is empty).

    Returns:
        True when the answer is empty.
    """
    if text is None:
        return True
    return parse_number(str(text)) is None and not normalize_math_answer(str(text))


def math_answers_match(prediction: str | None, gold: str) -> bool:
    """Whether a predicted math answer equals the gold one.

    Both sides that parse as numbers (``parse_number``) are compared exactly as fractions, so ``1,234``,
    ``1234.0`` and ``$1234`` equal ``1234`` while ``12345`` does not. Otherwise the normalised strings
    (``normalize_math_answer``) must be equal. A prediction holding a ``\\boxed{}`` is read from the box.

    Args:
        prediction: the policy's answer text (``None`` or empty never matches).
        gold: the reference answer (an empty one, ``is_empty_math_answer``, never matches).

    Returns:
        True on a match.
    """
    if prediction is None or not str(prediction).strip():
        return False
    boxed = extract_boxed(str(prediction))
    if boxed is not None:
        prediction = boxed
    pred_value, gold_value = parse_number(prediction), parse_number(gold)
    if pred_value is not None and gold_value is not None:
        return pred_value == gold_value
    pred_text, gold_text = normalize_math_answer(prediction), normalize_math_answer(gold)
    return bool(gold_text) and pred_text == gold_text
