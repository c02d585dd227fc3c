"""Confidence intervals of the study's tables: of a mean over seeds (Student t) and of
a difference of two means (Welch)."""

import math

import numpy as np


def confidence_interval(values, level=0.95):
    """Mean and half-width of the Student-t confidence interval of the mean.

    One value gives a half-width of `nan` (no spread to estimate).
    """
    from scipy import stats

    values = np.asarray(values, "float64")
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, math.nan
    sem = float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return mean, float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * sem


def difference_interval(treated, control, level=0.95):
    """Mean of `treated` minus mean of `control`, and the half-width of its Welch CI.

    The Welch-Satterthwaite interval does not assume equal variances. With fewer than
    two values on a side the half-width is `nan`.
    """
    from scipy import stats

    treated, control = np.asarray(treated, "float64"), np.asarray(control, "float64")
    difference = float(np.mean(treated) - np.mean(control))
    if len(treated) < 2 or len(control) < 2:
        return difference, math.nan
    va, vb = np.var(treated, ddof=1) / len(treated), np.var(control, ddof=1) / len(control)
    se = math.sqrt(va + vb)
    if se == 0:
        return difference, 0.0
    df = (va + vb) ** 2 / (va**2 / (len(treated) - 1) + vb**2 / (len(control) - 1))
    return difference, float(stats.t.ppf(0.5 + level / 2, df)) * se


def difference_text(difference, ci, scale=100, digits=2):
    """A difference and its CI half-width (fractions) as table text in points:
    `+d ± ci`, with `*` where the interval excludes 0; no interval where `ci` is NaN."""
    text = f"{scale * difference:+.{digits}f}"
    if math.isnan(ci):
        return text
    return text + f" ± {scale * ci:.{digits}f}" + (" *" if abs(difference) > ci else "")


def mean_ci_text(values, scale=100, digits=2):
    """`mean ± 95% CI` of `values` times `scale` (percent by default), for the tables;
    the mean alone for one value, `n/a` for none."""
    if len(values) == 0:
        return "n/a"
    mean, ci = confidence_interval(values)
    return f"{scale * mean:.{digits}f}" + ("" if math.isnan(ci) else f" ± {scale * ci:.{digits}f}")
