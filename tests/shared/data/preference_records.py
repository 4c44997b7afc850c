"""One preference pair in each shape tuneq reads (OpenAI's DPO format, TRL's with an explicit and
with an implicit prompt): a prompt offering a tool, a preferred answer that calls it, and one that
guesses. Read or rendered, the three must be the same pair."""

from __future__ import annotations

from typing import Any

from cli.samples import WEATHER_TOOL
from tests.shared.data.chat_records import TOOL_CALL

PROMPT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Oslo?"},
]
PREFERRED: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
OTHER: list[dict[str, Any]] = [{"role": "assistant", "content": "It is sunny."}]

OPENAI_DPO: dict[str, Any] = {
    "input": {"messages": PROMPT, "tools": [WEATHER_TOOL], "parallel_tool_calls": True},
    "preferred_output": PREFERRED,
    "non_preferred_output": OTHER,
}
TRL_EXPLICIT: dict[str, Any] = {"prompt": PROMPT, "chosen": PREFERRED, "rejected": OTHER, "tools": [WEATHER_TOOL]}
TRL_IMPLICIT: dict[str, Any] = {"chosen": PROMPT + PREFERRED, "rejected": PROMPT + OTHER, "tools": [WEATHER_TOOL]}
SHAPES = {"openai": OPENAI_DPO, "trl": TRL_EXPLICIT, "trl-implicit": TRL_IMPLICIT}
