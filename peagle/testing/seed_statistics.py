"""Telling a real difference from seed noise: benchmark variants compared over training seeds.

A draft's acceptance moves by a few hundredths from one training seed to the next, as much as
many of the changes a benchmark is asked to judge. :func:`welch` says whether the difference of
two variants' means over their seeds is beyond that noise (Welch's t-test, which does not assume
the two vary alike: a higher learning rate often varies more), and :func:`describe` is the
per-variant summary a results table shows.
"""

from __future__ import annotations

import math
import statistics

T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95% critical values of Student's t for 1..30 degrees of freedom (1.960 beyond)."""


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's t-test of mean(a) - mean(b): "beyond_noise" when |t| exceeds the two-sided 95%
    critical value at Welch's degrees of freedom (None with fewer than two values on a side)."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "t": None, "df": None, "t_crit": None, "beyond_noise": None}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return {"diff": diff, "t": None, "df": None, "t_crit": None, "beyond_noise": diff != 0}
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t_crit = T_975[max(1, math.floor(df)) - 1] if df < len(T_975) + 1 else 1.960  # floor(df): conservative
    return {"diff": diff, "t": t, "df": df, "t_crit": t_crit, "beyond_noise": abs(t) > t_crit}


def describe(values: list[float]) -> dict:
    """Mean, sample standard deviation and standard error of one variant's values over its seeds."""
    std = statistics.stdev(values) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "std": std, "se": std / math.sqrt(len(values)) if std is not None else None,
            "n": len(values), "values": values}


def describe_groups(records: list[dict], group: str, keys: tuple[str, ...]) -> dict[str, tuple[list[dict], dict]]:
    """Records grouped by ``record[group]`` (first-seen order): per group, its records and
    :func:`describe` of each of ``keys`` over them (None where a record lacks that figure).
    What every seed-table benchmark summarises before its own comparisons."""
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec[group], []).append(rec)
    return {name: (recs, {key: describe([r[key] for r in recs]) if all(r.get(key) is not None for r in recs)
                          else None for key in keys})
            for name, recs in groups.items()}
