"""What tuneq accepts inside a JSON value, wherever it came from: a request body
(``api.strict_json``) and a record of a data file (``shared.data.records``) get the same limits.

- nesting deeper than ``MAX_DEPTH``: no job field and no record field is nested that deep, and a
  parser's recursion (Python's ``json``, pydantic's, a chat template's) must never be what
  refuses it: Python's ``json`` raises ``RecursionError`` near a thousand levels, which reached
  the API's handlers as a 500;
- a NUL character in a string or a key: Postgres cannot store it in text, and tokenizers treat
  it as the end of the text;
- a lone UTF-16 surrogate (``"\\ud800"``): no character at all, it cannot be encoded as UTF-8,
  which is where a tokenizer fails (``TextEncodeInput must be ...``) mid-run.

The walk is iterative, so a value nested thousands deep does not recurse here either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# A DeepSpeed config is about 4 levels deep inside a job body, and a chat record's deepest field
# (a tool's JSON Schema: tools[0].function.parameters.properties.x.items...) rarely past 10; 32
# leaves plenty of room.
MAX_DEPTH = 32

Loc = tuple[str | int, ...]


def text_problem(text: str) -> str | None:
    """Why ``text`` (a string or a key) is refused, as the rest of a sentence about it; or None."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000), which Postgres text and tokenizers cannot take: remove it"
    if text.isascii():  # no surrogate, and no copy made to find out
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone UTF-16 surrogate (such as \\ud800), which is not a character: use valid Unicode"
    return None


@dataclass(frozen=True)
class ValueProblem:
    """Why a value is refused: ``loc`` is where in it (keys and indexes from its root; never the
    refused text itself, so a message naming it can be stored and shown as it is), ``message``
    the rest of a sentence about that place, and ``kind`` what is refused there."""

    loc: Loc
    message: str
    kind: Literal["too_deep", "string", "key", "leaf"]


def value_problem(value: Any, *, leaf_problem: Callable[[Any], str | None] | None = None) -> ValueProblem | None:
    """The first place found in ``value`` (depth first) past ``MAX_DEPTH`` or holding a refused
    string or key, or None. ``leaf_problem`` judges every other scalar."""
    pending: list[tuple[Loc, Any]] = [((), value)]
    while pending:
        loc, item = pending.pop()
        if len(loc) > MAX_DEPTH:
            return ValueProblem(loc[:MAX_DEPTH], f"is nested deeper than {MAX_DEPTH} levels", "too_deep")
        if isinstance(item, str):
            if (problem := text_problem(item)) is not None:
                return ValueProblem(loc, problem, "string")
        elif isinstance(item, dict):
            for key in item:
                if (problem := text_problem(key)) is not None:
                    return ValueProblem(loc, f"has a key that {problem}", "key")
            pending.extend(((*loc, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend(((*loc, index), child) for index, child in reversed(list(enumerate(item))))
        elif leaf_problem is not None and (problem := leaf_problem(item)) is not None:
            return ValueProblem(loc, problem, "leaf")
    return None
