"""Statistics of the study's tables: Student-t and Welch intervals, the Welch test, Holm's
adjustment and the Kaplan-Meier median of right-censored times (steps to an accuracy)."""

import math

import numpy as np


def confidence_interval(values, level=0.95):
    """Mean and half-width of the Student-t CI of the mean (`nan` for one value)."""
    from scipy import stats

    values = np.asarray(values, "float64")
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, math.nan
    sem = float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return mean, float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * sem


def _welch(treated, control):
    """Mean difference, its standard error and the Welch-Satterthwaite degrees of freedom."""
    treated, control = np.asarray(treated, "float64"), np.asarray(control, "float64")
    difference = float(np.mean(treated) - np.mean(control))
    if len(treated) < 2 or len(control) < 2:
        return difference, None, None
    va, vb = np.var(treated, ddof=1) / len(treated), np.var(control, ddof=1) / len(control)
    se = math.sqrt(va + vb)
    if se == 0:
        return difference, 0.0, None
    df = (va + vb) ** 2 / (va**2 / (len(treated) - 1) + vb**2 / (len(control) - 1))
    return difference, se, df


def difference_interval(treated, control, level=0.95):
    """Mean of `treated` minus mean of `control`, and its Welch CI half-width (`nan`: n < 2)."""
    from scipy import stats

    difference, se, df = _welch(treated, control)
    if se is None:
        return difference, math.nan
    if se == 0:
        return difference, 0.0
    return difference, float(stats.t.ppf(0.5 + level / 2, df)) * se


def welch_p_value(treated, control):
    """Two-sided p-value of Welch's t-test that `treated` and `control` share a mean; NaN
    with fewer than two values on a side; with no spread, 0 if the means differ, else 1."""
    from scipy import stats

    difference, se, df = _welch(treated, control)
    if se is None:
        return math.nan
    if se == 0:
        return 0.0 if difference != 0 else 1.0
    return float(2 * stats.t.sf(abs(difference) / se, df))


def holm_adjusted(p_values):
    """Holm's step-down adjustment of one family's p-values; NaN entries stay NaN."""
    p_values = [float(p) for p in p_values]
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted, running = list(p_values), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def kaplan_meier_median(times, observed):
    """Kaplan-Meier median of right-censored `times` (`observed[i]` false: censored), as
    lifelines reports it; `None` where the survival function stays above 0.5."""
    from scipy import stats

    times, observed = np.asarray(times, "float64"), np.asarray(observed, bool)
    if len(times) == 0:
        return None
    survival = stats.ecdf(stats.CensoredData(uncensored=times[observed],
                                             right=times[~observed])).sf
    below = survival.quantiles[survival.probabilities <= 0.5 + 1e-12]  # 0.5 up to rounding
    return float(below[0]) if len(below) else None


def p_value_text(p, holm=False):
    """A p-value as table text: three decimals (`<0.001` below that), `n/a` for NaN; an
    adjusted one (`holm=True`) is marked `*` below 0.05."""
    if p is None or math.isnan(p):
        return "n/a"
    text = "<0.001" if p < 0.0005 else f"{p:.3f}"
    return text + (" *" if holm and p < 0.05 else "")


def p_value_header(count):
    """The two p-value columns' header cells for a table of `count` comparisons."""
    return f"p (Welch) | p, Holm-adjusted over {count} comparison{'s' if count != 1 else ''}"


def table_text(header, rows):
    """A markdown table of the `header` cells and `rows`; `""` without rows."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(cells) + " |" for cells in (header, *rows)]
    return "\n".join([lines[0], "|" + "---|" * len(header), *lines[1:]]) + "\n"


def p_value_table(header, rows):
    """A markdown table of `rows`, each `(cells, p)`, with `p` and its Holm adjustment
    over the table appended (blank where `p` is `None`); `""` without rows."""
    if not rows:
        return ""
    p_values = [math.nan if p is None else p for _, p in rows]
    tested = sum(not math.isnan(p) for p in p_values)
    lines = ["| " + " | ".join([*header, p_value_header(tested)]) + " |",
             "|" + "---|" * (len(header) + 2)]
    for (cells, p), p_holm in zip(rows, holm_adjusted(p_values)):
        tests = ["", ""] if p is None else [p_value_text(p), p_value_text(p_holm, holm=True)]
        lines.append("| " + " | ".join([*cells, *tests]) + " |")
    return "\n".join(lines) + "\n"


def difference_row(cells, treated, control):
    """A `p_value_table` row: `cells` and `treated` minus `control` in points (Welch 95%
    CI) with its Welch p-value; `n/a` and NaN without both sides."""
    if not treated or not control:
        return cells + ["n/a"], math.nan
    return (cells + [difference_text(*difference_interval(treated, control))],
            welch_p_value(treated, control))


def difference_text(difference, ci, scale=100, digits=2):
    """A difference and its CI half-width (fractions) as table text in points:
    `+d ± ci`, with `*` where the interval excludes 0; no interval where `ci` is NaN."""
    text = f"{scale * difference:+.{digits}f}"
    if math.isnan(ci):
        return text
    return text + f" ± {scale * ci:.{digits}f}" + (" *" if abs(difference) > ci else "")


def mean_ci_text(values, scale=100, digits=2):
    """`mean ± 95% CI` of `values` times `scale`; the mean alone for one value, `n/a` for none."""
    if len(values) == 0:
        return "n/a"
    mean, ci = confidence_interval(values)
    return f"{scale * mean:.{digits}f}" + ("" if math.isnan(ci) else f" ± {scale * ci:.{digits}f}")
