"""The name of a shared-data unit, as both ends of the wire spell it.

In shared-data mode (pretraining) one deterministic data stream is cut into units ``u0, u1,
...``; the coordinator names the unit a site trains in ``RoundInfo.data_unit`` and the site
names it back in its push. Both sides parse the name here and nowhere else. ``k`` is bounded by
what an int64 holds, because the trainers broadcast it as one.
"""

from __future__ import annotations

import re

_UNIT = re.compile(r"u(0|[1-9][0-9]{0,17})")


class UnitError(ValueError):
    """A string that is not a data unit name."""


def unit_id(k: int) -> str:
    """The name of unit ``k`` of the data stream."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise UnitError(f"a data unit index is an int >= 0, got {k!r}")
    return f"u{k}"


def parse_unit(unit: object) -> int:
    """The stream index ``k`` of ``"u<k>"``.

    Raises
    ------
    UnitError
        ``unit`` is not ``"u<k>"`` with ``0 <= k < 10**18``.
    """
    match = _UNIT.fullmatch(unit) if isinstance(unit, str) else None
    if match is None:
        raise UnitError(f"malformed data unit id {str(unit)[:30]!r}; expected 'u<k>' with k >= 0")
    return int(match.group(1))
