"""Statistics of the timing samples and the formatting of figures.

A row's samples are grouped in rounds; its time is the median of the round medians and
its spread the interquartile range (IQR) of the round medians, with quartiles by linear
interpolation (as ``numpy.percentile``). A ratio of two medians carries the propagated
relative error ``r * sqrt((iqr_a / med_a)^2 + (iqr_b / med_b)^2)``.

>>> summarize([[1.0, 3.0, 2.0], [4.0], [2.0, 2.5]])
(2.25, 1.0)
>>> format_time(0.00123, 0.00005)
'1.23 ± 0.050 ms'
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

SIGNIFICANT = 0.05
"""A ratio is marked when it differs from 1 by more than its error and by more than 5 %."""


def quantile(values: Sequence[float], q: float) -> float:
    """The `q`-quantile of `values`, linearly interpolated (numpy.percentile's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(rounds: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(median, IQR) of the medians of the non-empty `rounds`."""
    medians = [statistics.median(r) for r in rounds if len(r)]
    if not medians:
        raise ValueError("no samples")
    return statistics.median(medians), quantile(medians, 0.75) - quantile(medians, 0.25)


def ratio(med_a: float, iqr_a: float, med_b: float, iqr_b: float) -> tuple[float, float]:
    """``med_a / med_b`` and its propagated error.

    >>> r, err = ratio(2.0, 0.2, 1.0, 0.1)
    >>> r, round(err, 6)
    (2.0, 0.282843)
    """
    r = med_a / med_b
    return r, r * math.hypot(iqr_a / med_a, iqr_b / med_b)


def significance(r: float, err: float) -> str:
    """'faster' or 'slower' for a base / new time ratio that is significant, else ''."""
    if abs(r - 1) <= max(err, SIGNIFICANT):
        return ""
    return "faster" if r > 1 else "slower"


def significant(x: float, digits: int) -> str:
    """`x` to `digits` significant digits, never in exponent notation.

    >>> significant(221.7, 2), significant(0.01234, 2), significant(1234.5, 3), significant(0, 2)
    ('220', '0.012', '1230', '0')
    """
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    exponent = math.floor(math.log10(abs(x)))
    decimals = digits - 1 - exponent
    rounded = round(x, decimals)
    if rounded and math.floor(math.log10(abs(rounded))) > exponent:  # 9.99 -> 10.0: one digit fewer
        decimals -= 1
    return f"{round(x, decimals):.{max(decimals, 0)}f}"


TIME_UNITS = ((1e-6, "ns", 1e9), (1e-3, "μs", 1e6), (1.0, "ms", 1e3), (math.inf, "s", 1.0))


def _time_unit(seconds: float) -> tuple[str, float]:
    for bound, unit, scale in TIME_UNITS:
        if seconds < bound:
            break
    return unit, scale


def format_time(median: float, iqr: float) -> str:
    """``median ± IQR`` in the median's unit, 3 significant digits for the median."""
    unit, scale = _time_unit(median)
    return f"{significant(median * scale, 3)} ± {significant(iqr * scale, 2)} {unit}"


def format_duration(seconds: float) -> str:
    """One duration, 3 significant digits: ``format_duration(0.8123) == '812 ms'``."""
    unit, scale = _time_unit(seconds)
    return f"{significant(seconds * scale, 3)} {unit}"


def format_ratio(r: float, err: float) -> str:
    """``1.02 ± 0.04``."""
    return f"{significant(r, 3)} ± {significant(err, 2)}"


def format_bytes(n: float) -> str:
    """Decimal units, 3 significant digits: ``format_bytes(2048) == '2.05 kB'``."""
    for unit, scale in (("B", 1.0), ("kB", 1e3), ("MB", 1e6)):
        if abs(n) < 1000 * scale:
            return f"{significant(n / scale, 3)} {unit}"
    return f"{significant(n / 1e9, 3)} GB"


def format_count(n: float) -> str:
    """An integer as is, a fraction with 3 significant digits."""
    return str(int(n)) if float(n).is_integer() else significant(n, 3)


def format_allocs(allocs: float, nbytes: float) -> str:
    """A memory cell, AirspeedVelocity's way: ``N allocs: X kB`` per call (MB, GB when
    larger).

    >>> format_allocs(2, 1024), format_allocs(60, 2398208)
    ('2 allocs: 1.02 kB', '60 allocs: 2.40 MB')
    """
    size = format_bytes(nbytes) if nbytes >= 1e6 else f"{significant(nbytes / 1e3, 3)} kB"
    return f"{format_count(allocs)} allocs: {size}"
