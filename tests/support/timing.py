"""One setting for every wait of the suite: MESHGROUPS_TEST_TIME_SCALE (default 1; CI sets 3).

A timeout, a sleep that orders ranks, or a bound on how long something may take is written as
``scaled(nominal_seconds)``; ``tests/_dist.run`` scales job and default-group timeouts itself and
``tests/conftest.py`` scales pytest-timeout's per-test limit. A loaded machine then gets longer
waits, never a different verdict. Torch-free, so conftest can import it cheaply.
"""

from __future__ import annotations

import os


def _time_scale() -> float:
    raw = os.environ.get("MESHGROUPS_TEST_TIME_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"MESHGROUPS_TEST_TIME_SCALE={raw!r} must be a number") from None
    if not 0 < scale < 1000:
        raise ValueError(f"MESHGROUPS_TEST_TIME_SCALE={raw!r} must be a positive number below 1000")
    return scale


TIME_SCALE = _time_scale()


def scaled(seconds: float) -> float:
    """``seconds`` times MESHGROUPS_TEST_TIME_SCALE.

    >>> scaled(20) == 20 * TIME_SCALE
    True
    """
    return seconds * TIME_SCALE
