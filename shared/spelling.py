"""The "did you mean ..." of every refusal of a name tuneq does not know: a DeepSpeed config key,
an optimizer or scheduler type, a field of a request body."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_name(word: str, known: Iterable[str], *, ignore_case: bool = False) -> str | None:
    """The name in ``known`` that ``word`` is most likely a misspelling of, or None when none
    is close. With ``ignore_case``, names are compared in lower case and the first of ``known``
    (in its order) with the closest spelling is answered."""
    names = list(known)
    if not ignore_case:
        close = difflib.get_close_matches(word, sorted(names), n=1, cutoff=0.6)
        return close[0] if close else None
    by_lower: dict[str, str] = {}
    for name in names:
        by_lower.setdefault(name.lower(), name)
    close = difflib.get_close_matches(word.lower(), sorted(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def did_you_mean(word: str, known: Iterable[str], *, ignore_case: bool = False) -> str | None:
    """``"did you mean 'x'?"`` for the closest name to ``word`` (see :func:`closest_name`), or None."""
    close = closest_name(word, known, ignore_case=ignore_case)
    return f"did you mean '{close}'?" if close is not None else None
