"""Measurements over whole runs: pure functions of accuracy curves."""

import math
from collections.abc import Sequence


def r_name(target: float) -> str:
    """The metric name of an R-index target: 0.6 -> ``R60``, 0.925 -> ``R92.5``."""
    return f"R{round(100 * target, 4):g}"


def r_index(rounds: Sequence[int], accuracy: Sequence[float], target: float) -> int | None:
    """The first round (1-based) at which ``accuracy`` reached ``target``, or None if it never did.

    Rounds that were not evaluated carry NaN and are skipped.
    """
    for t, a in zip(rounds, accuracy):
        if not math.isnan(a) and a >= target:
            return int(t)
    return None
