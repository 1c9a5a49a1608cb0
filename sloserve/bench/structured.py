"""What `sloserve bench --structured` asks of every chat request: a JSON record under a schema
(`json`), a call forced to one of three tools (`tools`), or an agent's round trip (`agent`): that
forced call, then, as soon as it is answered, a second call carrying the conversation so far, the
call and a tool result back for the answer in words (the prefix the first call left cached is
the second's to reuse, and a tool loop pays its TTFT twice). The output of a constrained call ends
when the constraint is complete, so these requests never send ignore_eos."""
from __future__ import annotations

from typing import Any

STRUCTURED_KINDS = ("json", "tools", "agent")
TOOL_RESULT = '{"status": "ok", "results": 3}'  # what the agent's tool returns

RECORD = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "summary": {"type": "string", "maxLength": 200},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["title", "summary", "tags", "score"], "additionalProperties": False}

TOOLS = [
    {"type": "function", "function": {"name": "search_documents", "description": "Full-text search of the knowledge base",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 120},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                                          "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "create_ticket", "description": "Open a support ticket",
                                      "parameters": {"type": "object", "properties": {
                                          "title": {"type": "string", "maxLength": 80},
                                          "priority": {"enum": ["low", "normal", "high"]}},
                                          "required": ["title", "priority"], "additionalProperties": False}}},
]


def structured_fields(kind: str) -> dict[str, Any]:
    """The body fields that ask for `kind`."""
    if kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}}
    if kind in ("tools", "agent"):
        return {"tools": TOOLS, "tool_choice": "required", **({"parallel_tool_calls": False} if kind == "agent" else {})}
    raise ValueError(f"structured must be one of {', '.join(STRUCTURED_KINDS)}, got {kind!r}")


def answer_turn(body: dict[str, Any], content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's second call: the first call's conversation, the assistant's calls and a result
    for each, the tools still declared but none forced (tool_choice none: an answer in words)."""
    messages = [*body["messages"], {"role": "assistant", "content": content or None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in calls]
    return {**body, "messages": messages, "tool_choice": "none"}
