"""What the Responses API tests share (test_api_responses.py, test_api_response_store.py): the settings of a
short greedy response, a function tool in both forms, and calls whose JSON is checked against the SDK's models
(the client itself builds its objects without validating them)."""

from __future__ import annotations

import json

from openai.types.responses import Response, ResponseItemList

GREEDY = dict(model="demo-chat", temperature=0, max_output_tokens=8)
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


async def create_response(c, **kw) -> Response:
    """responses.create, its JSON checked against the SDK's Response model field by field."""
    raw = await c.responses.with_raw_response.create(**kw)
    return Response.model_validate(json.loads(raw.text))


async def list_input_items(c, response_id, **kw) -> ResponseItemList:
    """input_items.list's JSON, checked against the SDK's list and item models."""
    raw = await c.responses.input_items.with_raw_response.list(response_id, **kw)
    return ResponseItemList.model_validate(json.loads(raw.text))


async def chat_completion(c, messages, **kw):
    return await c.chat.completions.create(**{"model": "demo-chat", "temperature": 0, "max_tokens": 8, **kw},
                                           messages=messages)
