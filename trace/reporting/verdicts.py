"""Verdicts on the report's paired differences: p-values from the intervals that decide them, declared
families with Holm's step-down correction, equivalence and non-superiority against a margin, and power.

Pure functions of ``trace.reporting.statistics.Interval`` (numpy and ``scipy.stats``); the report
(``trace.reporting.report_markdown``, ``report_json``) and the docs tables (``scripts.docs_tables_runs``, which
rebuild the intervals from a committed ``metrics.json``) call the same functions, so they decide alike.
docs/method.md, "Statistics over seeds", states the rule; in short:

- A difference has one or two intervals: the t-interval over seeds, and where per-question results exist the
  paired bootstrap over questions and seeds (``Interval.seed_interval`` is then the t-interval). It is real only
  when every one of its intervals excludes 0.
- Its p-value is the largest of its intervals' two-sided p-values (both must reject, so the larger one decides,
  and ``deciding_p`` names it). A t-interval's p is exact: ``se = half-width / t_{(1+c)/2, n-1}``, ``p = 2 P(T_{n-1}
  > |mean| / se)``. A bootstrap interval's p is the normal one of its near side (``se = (mean - low) / z_{(1+c)/2}``
  for a positive mean, ``(high - mean) / z`` for a negative one): it needs only the stored interval, so a report
  and a table rebuilt from its ``metrics.json`` give the same p, and ``p < 1 - c`` exactly when that percentile
  interval excludes 0 (the mean over S x Q cells is near normal; the bootstrap distribution itself is not kept).
- Families (``FAMILIES``): the primary one is held-out avg@k, each arm minus ``grpo``; the secondary ones are greedy,
  effective ratio (and effective token ratio), generated tokens (each minus ``grpo``), every column minus
  ``trace``, and the gains over the warmup. Holm's step-down (``holm``) adjusts the p-values within each family;
  "real after correction" means an adjusted p below ``ALPHA``.
- Against a margin ``delta`` (``report.margin``), each primary comparison gets one of ``MARGIN_WORDS``
  (``margin_verdict``), read on its deciding interval widened to the family-wise level ``1 - ALPHA / m``
  (Bonferroni over the m primary comparisons; equivalence this way is TOST at ``ALPHA / (2 m)`` per side).
- A diagnostic arm (``trace.allocation.arms.DIAGNOSTIC_ARMS``: ``trace_oracle``, a bound, not a method) is a family
  of its own in every family, so adding it changes no method's correction or margin level.
- Power (``trace.reporting.power.power_of``): the minimum detectable difference at 80 % power, two-sided 5 %, from the seed component
  (the t-interval's standard error, exact with the noncentral t) and the question component (the bootstrap's
  variance beyond the seed interval's), and the seeds and questions each component needs to reach ``delta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from trace.allocation.arms import DIAGNOSTIC_ARMS
from trace.reporting.power import ALPHA, MAX_SEEDS, POWER, Power, _quantile, _z, minimum_detectable_difference, \
    power_of, standard_errors
from trace.reporting.statistics import BOOTSTRAP, Interval

DEFAULT_MARGIN = 0.02  # report.margin: the paper's effect size in held-out accuracy (docs/method.md)
# (name, versus key of arm_statistics, columns): the report's families, the primary one first
PRIMARY = "primary: held-out avg@k minus grpo"
FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (PRIMARY, "vs_grpo", ("eval mean@k",)),
    ("greedy minus grpo", "vs_grpo", ("eval greedy",)),
    ("effective ratio minus grpo", "vs_grpo", ("effective ratio", "effective token ratio")),
    ("generated tokens minus grpo", "vs_grpo", ("generated tokens",)),
    ("minus trace", "vs_trace", ("eval mean@k", "eval greedy", "effective ratio", "effective token ratio",
                                 "generated tokens")),
    ("gain over warmup", "vs_warmup", ("eval mean@k", "eval greedy")),
)
BETTER, WORSE, EQUIVALENT, NOT_WORSE, NOT_BETTER, UNDECIDED = (
    "better by >= delta", "worse", "equivalent within ±delta", "not worse (non-inferior)",
    "not better by delta (non-superior)", "undecided")
MARGIN_WORDS = (BETTER, WORSE, EQUIVALENT, NOT_WORSE, NOT_BETTER, UNDECIDED)


def p_value(iv: Interval) -> float:
    """Two-sided p-value of "the difference is 0" from one interval (``standard_errors``): ``2 P(T_df >
    |mean| / se)`` with ``se`` the standard error on the side of 0.

    Args:
        iv: a t or bootstrap interval (its ``seed_interval`` is not read: ``deciding_p`` reads both).

    Returns:
        p in [0, 1]; NaN without an interval. ``p < 1 - iv.confidence`` exactly when ``iv`` excludes 0.

    References:
        Student (1908); the inversion of a confidence interval into a test (Casella & Berger, "Statistical
        Inference", 2nd ed., section 9.2.1).
    """
    from scipy.stats import norm, t

    se_low, se_high, df = standard_errors(iv)
    if not math.isfinite(se_low + se_high):
        return float("nan")
    se = se_low if iv.mean > 0 else se_high
    if se <= 0:
        return 1.0 if iv.mean == 0 else 0.0
    stat = abs(iv.mean) / se
    return float(min(1.0, 2.0 * (norm.sf(stat) if math.isinf(df) else t.sf(stat, df))))


def deciding_p(iv: Interval) -> tuple[float, str]:
    """The p-value of a difference and the estimator that gave it: the larger of its interval's and its
    ``seed_interval``'s (a difference is real only when both exclude 0, so the weaker one decides).

    Args:
        iv: a paired difference (``paired_difference`` or ``paired_bootstrap``).

    Returns:
        ``(p, "t" or "bootstrap")``; ``(NaN, estimator)`` without an interval.
    """
    candidates = [(p_value(iv), iv.estimator)]
    if iv.seed_interval is not None:
        candidates.append((p_value(iv.seed_interval), iv.seed_interval.estimator))
    if any(math.isnan(p) for p, _ in candidates):
        return float("nan"), iv.estimator
    return max(candidates, key=lambda c: c[0])


def widened(iv: Interval, confidence: float) -> tuple[float, float]:
    """One interval's bounds at another coverage, from its ``standard_errors`` (NaNs without an interval)."""
    se_low, se_high, df = standard_errors(iv)
    q = _quantile((1.0 + confidence) / 2.0, df) if math.isfinite(se_low) else float("nan")
    return iv.mean - q * se_low, iv.mean + q * se_high


def deciding_bounds(iv: Interval, confidence: float) -> tuple[float, float]:
    """The hull of a difference's intervals (its own and its ``seed_interval``) at ``confidence``: the range
    every one of them allows, which the margin verdicts read."""
    bounds = [widened(iv, confidence)] + ([widened(iv.seed_interval, confidence)] if iv.seed_interval else [])
    return min(b[0] for b in bounds), max(b[1] for b in bounds)


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values of one family.

    Sorted ascending, ``p_(1) <= ... <= p_(m)``, the adjusted value of the i-th is
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``; a hypothesis is rejected at family-wise level ``alpha`` when
    its adjusted p is below ``alpha`` (the same as Holm's sequential rule). NaN p-values (no interval) are
    left out of ``m`` and stay NaN. Ties keep the input order.

    Args:
        p_values: name -> raw p in [0, 1] (or NaN).

    Returns:
        name -> adjusted p, in the input's order.

    References:
        Holm, "A simple sequentially rejective multiple test procedure", Scandinavian Journal of Statistics 6(2)
        (1979); the adjusted p-values of Wright, "Adjusted p-values for simultaneous inference", Biometrics
        48(4) (1992).
    """
    finite = sorted(((p, i, name) for i, (name, p) in enumerate(p_values.items()) if not math.isnan(p)))
    m = len(finite)
    out = {name: float("nan") for name in p_values}
    running = 0.0
    for j, (p, _, name) in enumerate(finite):
        running = max(running, min(1.0, (m - j) * p))
        out[name] = running
    return out


def margin_verdict(low: float, high: float, margin: float) -> str:
    """One of ``MARGIN_WORDS`` for a difference whose deciding interval is ``[low, high]``.

    In this order: ``low >= margin`` better by >= delta; ``high < 0`` worse; ``-margin < low`` and ``high <
    margin`` equivalent within ±delta (the two one-sided tests both reject); ``low > -margin`` not worse
    (non-inferior); ``high < margin`` not better by delta (non-superior); otherwise undecided.

    Args:
        low: lower bound (NaN: undecided).
        high: upper bound.
        margin: delta > 0, in the difference's unit.

    Raises:
        ValueError: ``margin <= 0``.

    References:
        Schuirmann, "A comparison of the two one-sided tests procedure and the power approach for assessing the
        equivalence of average bioavailability", J. Pharmacokinetics and Biopharmaceutics 15(6) (1987): TOST as
        an interval inside ``(-delta, delta)``. Walker & Nowacki, "Understanding equivalence and noninferiority
        testing", J. General Internal Medicine 26(2) (2011).
    """
    if not margin > 0:
        raise ValueError(f"the margin must be positive, got {margin!r} (report.margin in params.yaml)")
    if not (math.isfinite(low) and math.isfinite(high)):
        return UNDECIDED
    if low >= margin:
        return BETTER
    if high < 0:
        return WORSE
    if low > -margin and high < margin:
        return EQUIVALENT
    if low > -margin:
        return NOT_WORSE
    if high < margin:
        return NOT_BETTER
    return UNDECIDED


@dataclass(frozen=True)
class Verdict:
    """The verdict on one paired difference within its family.

    Attributes:
        family: its family's name (``FAMILIES``).
        mean: the mean difference (its sign gives the side of a real one).
        p: its p-value (``deciding_p``), NaN without an interval.
        decided_by: the estimator whose interval gave ``p`` (``t`` or ``bootstrap``).
        p_adjusted: Holm's adjusted p within the family.
        family_size: m, the family's comparisons with a p-value.
        real: ``p < ALPHA`` (every interval excludes 0, before correction).
        real_corrected: ``p_adjusted < ALPHA``.
    """

    family: str
    mean: float
    p: float
    decided_by: str
    p_adjusted: float
    family_size: int
    real: bool
    real_corrected: bool

    @property
    def words(self) -> str:
        """``real after correction``, ``real before correction only``, ``within noise`` or ``no interval``."""
        if math.isnan(self.p):
            return "no interval"
        if self.real_corrected:
            return "real after correction"
        return "real before correction only" if self.real else "within noise"


def family_verdicts(arms: Mapping[str, Mapping[str, Mapping[str, Interval]]],
                    families: Iterable[tuple[str, str, tuple[str, ...]]] = FAMILIES) -> dict:
    """Holm's correction within each family over every arm.

    Args:
        arms: ablation -> versus key (``vs_grpo``, ``vs_trace``, ``vs_warmup``) -> column -> ``Interval``
            (``arm_statistics``' entries, or those rebuilt from ``metrics.json``).
        families: ``FAMILIES``.

    Returns:
        ``{(arm, versus, column): Verdict}`` for every difference some family holds.
    """
    out: dict = {}
    methods = [arm for arm in arms if arm not in DIAGNOSTIC_ARMS]
    # a diagnostic arm (trace_oracle, a bound) is its own family: adding it changes no method's correction
    for name, versus, columns in families:
        for members_of, label in [(methods, name)] + [([arm], f"{name} ({arm}, diagnostic)") for arm in arms
                                                       if arm in DIAGNOSTIC_ARMS]:
            members = {(arm, versus, c): arms[arm][versus][c] for arm in members_of
                       for c in columns if c in arms[arm].get(versus, {})}
            raw = {key: deciding_p(iv) for key, iv in members.items()}
            adjusted = holm({key: p for key, (p, _) in raw.items()})
            size = sum(not math.isnan(p) for p, _ in raw.values())
            for key, (p, by) in raw.items():
                out[key] = Verdict(label, members[key].mean, p, by, adjusted[key], size, bool(p < ALPHA),
                                   bool(adjusted[key] < ALPHA))
    return out


def primary_margins(arms: Mapping[str, Mapping[str, Mapping[str, Interval]]], margin: float,
                    alpha: float = ALPHA) -> dict[str, tuple[str, float, float]]:
    """Each primary comparison's ``margin_verdict`` on its deciding interval at level ``1 - alpha / m``.

    Args:
        arms: as ``family_verdicts``.
        margin: delta > 0.
        alpha: family-wise level.

    Returns:
        ``{arm: (words, low, high)}`` for the arms with a primary comparison.
    """
    _, versus, (column,) = FAMILIES[0]
    members = {arm: by_versus[versus][column] for arm, by_versus in arms.items()
               if column in by_versus.get(versus, {}) and by_versus[versus][column].has_interval}
    m = sum(arm not in DIAGNOSTIC_ARMS for arm in members)  # a diagnostic arm is read at 1 - alpha alone
    out = {}
    for arm, iv in members.items():
        low, high = deciding_bounds(iv, 1.0 - alpha / (1 if arm in DIAGNOSTIC_ARMS else m))
        out[arm] = (margin_verdict(low, high, margin), low, high)
    return out


def groups(arm_names: Iterable[str], baseline: str, verdicts: Mapping, versus: str = "vs_grpo",
           column: str = "eval mean@k") -> dict[str, str]:
    """Arms grouped by whether they are distinguishable from ``baseline`` after correction, instead of a rank.

    Args:
        arm_names: every arm.
        baseline: the arm the others are compared with (in the middle group).
        verdicts: ``family_verdicts`` output.
        versus, column: the comparison that groups (the primary one).

    Returns:
        arm -> ``above <baseline>``, ``as <baseline>`` (within noise after correction, or no interval) or
        ``below <baseline>``; the signed mean decides the side of a real difference.
    """
    out = {}
    for arm in arm_names:
        verdict = verdicts.get((arm, versus, column))
        side = "as"
        if verdict is not None and verdict.real_corrected:
            side = "above" if verdict.mean > 0 else "below"
        out[arm] = f"{side} {baseline}"
    return out


def judge(arms: Mapping[str, Mapping[str, Mapping[str, Interval]]], margin: float = DEFAULT_MARGIN,
          baseline: str = "grpo") -> dict:
    """Everything the report says of its differences: Holm within each family, the primary family's margin
    verdicts and power, and the arms grouped against ``baseline``.

    Args:
        arms: as ``family_verdicts`` (``arm_statistics``' arms hold ``vs_grpo``, ``vs_trace``, ``vs_warmup``).
        margin: delta (``report.margin``).
        baseline: the arm the primary family compares with.

    Returns:
        ``{"verdicts": family_verdicts, "margins": primary_margins, "power": {arm: Power}, "groups": {arm:
        group}, "group_column": the column that grouped (avg@k, or greedy where no arm has an avg@k interval)}``.
    """
    verdicts = family_verdicts(arms)
    _, versus, (column,) = FAMILIES[0]
    power = {arm: power_of(by[versus][column], margin) for arm, by in arms.items()
             if column in by.get(versus, {}) and by[versus][column].has_interval}
    has_primary = any(not math.isnan(v.p) for (_, vs, c), v in verdicts.items() if (vs, c) == (versus, column))
    group_column = column if has_primary else "eval greedy"
    return {"verdicts": verdicts, "margins": primary_margins(arms, margin), "power": power,
            "groups": groups(list(arms), baseline, verdicts, versus, group_column), "group_column": group_column}
