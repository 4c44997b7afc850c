"""A chat record with everything OpenAI's chat fine-tuning format has, for the tests of reading
and of tokenizing it: a system prompt, a developer note, an untrained (weight 0) turn, a tool
call with null content and its result, a trained answer, and the tools offered."""

from __future__ import annotations

from typing import Any

from cli.samples import WEATHER_TOOL

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
OPENAI_CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me think.", "weight": 0},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'},
        {"role": "assistant", "content": "3 degrees.", "weight": 1},
    ],
    "tools": [WEATHER_TOOL],
    "parallel_tool_calls": False,
}
