"""Statistics of repeated timings, as PROFILING.md defines them: median, p90, CV, bootstrap CI."""

from __future__ import annotations

from typing import Sequence

import numpy as np

NOISY_CV = 0.10  # a run whose coefficient of variation exceeds this is flagged "noisy"


def summarize(samples: Sequence[float], seed: int = 0, resamples: int = 2000) -> dict:
    """median, p90, cv and a bootstrap 95% confidence interval of the median, plus flags."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no samples")
    med = float(np.median(x))
    mean = float(x.mean())
    cv = float(x.std(ddof=1) / mean) if x.size > 1 and mean != 0 else 0.0
    if x.size > 1:
        rng = np.random.default_rng(seed)
        meds = np.median(rng.choice(x, size=(resamples, x.size), replace=True), axis=1)
        lo, hi = np.percentile(meds, [2.5, 97.5])
    else:
        lo = hi = med
    flags = []
    if cv > NOISY_CV:
        flags.append("noisy")
    if x.size < 5:
        flags.append("few_samples")
    return {
        "median": med,
        "p90": float(np.percentile(x, 90)),
        "cv": cv,
        "ci95": [float(lo), float(hi)],
        "n": int(x.size),
        "flags": flags,
    }


def ratio_ci(a: Sequence[float], b: Sequence[float], seed: int = 0, resamples: int = 2000) -> dict:
    """median(a) / median(b) with a bootstrap 95% interval (independent resampling of both)."""
    xa, xb = np.asarray(a, np.float64), np.asarray(b, np.float64)
    rng = np.random.default_rng(seed)
    ma = np.median(rng.choice(xa, size=(resamples, xa.size)), axis=1)
    mb = np.median(rng.choice(xb, size=(resamples, xb.size)), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero median (a compare file's) is an inf ratio, said so
        r = ma / mb
        lo, hi = np.percentile(r, [2.5, 97.5])
        ratio = float(np.median(xa) / np.median(xb))
    return {
        "ratio": ratio,
        "ci95": [float(lo), float(hi)],
        "significant": bool(lo > 1.0 or hi < 1.0),
    }
