"""JSON schemas for constrained decoding, each bounded (strings, numbers, arrays), and the same schemas closed: what
the grammar's unit tests and the API's structured output through a live server answer to."""

from __future__ import annotations

# bounded (strings, numbers, arrays): a schema that allows a 500-digit number lets a sampled answer be one
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": -99, "maximum": 99},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "null"}]}},
        "required": ["v"],
    },
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}}, "required": ["id"]},
]


def closed(schema):
    """The schema with every object closed (no keys beyond its properties: random logits would name endless ones)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out["additionalProperties"] = False
        return out
    return [closed(v) for v in schema] if isinstance(schema, list) else schema
