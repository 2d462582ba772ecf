"""JSON Schema rewrites applied before a schema becomes a grammar (structured outputs and tool arguments).

Under a grammar a small model does not stop on its own where the schema leaves it room: it appends
invented keys to open objects, or writes digits until max_tokens cuts the JSON off
(`"population": 1111111111...`), and the client gets text that does not parse. Two rewrites close
that room without rejecting any output a client could use:

- `close_json_schema`: an object that lists `properties` and says nothing of `additionalProperties`
  gets `additionalProperties: false` (OpenAI's strict mode does the same). Used for strict
  response formats and tool arguments.
- `bound_json_numbers`: the number policy, applied to every JSON constraint.
  * an "integer" or "number" without a lower (upper) bound gets minimum -(2**53 - 1) (maximum
    2**53 - 1): the range RFC 8259 calls interoperable, exact in every JSON parser (JavaScript
    included), so at most 16 digits;
  * a "number" without `multipleOf` gets multipleOf 1e-9: at most 9 digits after the point, plain
    decimal notation (no exponent). More is noise past a double's precision anyway.
  Explicit bounds and `multipleOf` in the schema are kept as they are. `ANY_JSON_OBJECT`, what
  response_format json_object compiles to, is any JSON object with its numbers bounded the same way.

Strings are left unbounded on purpose (a summary or a code snippet may be long); like everything
else they are ended by the token reserve of engine/grammar_budget.py, which closes the JSON when
max_tokens is about to run out.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

SAFE_INTEGER = 2**53 - 1  # Number.MAX_SAFE_INTEGER
NUMBER_STEP = 1e-9  # at most 9 fraction digits

_OBJECT_SUBSCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
                      "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_LIST_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

_BOUNDED_NUMBER = {"type": "number", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER, "multipleOf": NUMBER_STEP}
ANY_JSON_OBJECT: dict[str, Any] = {
    "$defs": {"value": {"anyOf": [
        {"type": "null"}, {"type": "boolean"}, {"type": "string"}, _BOUNDED_NUMBER,
        {"type": "array", "items": {"$ref": "#/$defs/value"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
    ]}},
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
}


def map_schema(schema: Any, rewrite: Callable[[dict], dict]) -> Any:
    """`schema` with `rewrite` applied to every (sub)schema object, children first. Pure: the input is
    not modified."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _OBJECT_SUBSCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = map_schema(out[key], rewrite)
    for key in _LIST_SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [map_schema(s, rewrite) for s in out[key]]
    for key in _MAP_SUBSCHEMAS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: map_schema(s, rewrite) for name, s in out[key].items()}
    return rewrite(out)


def close_json_schema(schema: Any) -> Any:
    """`schema` with every object that lists properties but says nothing of additionalProperties (nor
    patternProperties) closed, at any depth. Under a grammar an open object lets a small model append
    invented keys until max_tokens cuts the JSON off; OpenAI's strict mode requires closed objects."""
    return map_schema(schema, _close_object)


def _close_object(node: dict) -> dict:
    if "properties" in node and "additionalProperties" not in node and "patternProperties" not in node:
        node["additionalProperties"] = False
    return node


def bound_json_numbers(schema: Any) -> Any:
    """`schema` with every unbounded integer / number bounded as the module docstring says."""
    return map_schema(schema, _bound_number)


def _number_value(node: dict, key: str) -> float | None:
    value = node.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bound_number(node: dict) -> dict:
    kinds = node.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if not kinds & {"integer", "number"}:
        return node
    low = _number_value(node, "minimum") if "minimum" in node else _number_value(node, "exclusiveMinimum")
    high = _number_value(node, "maximum") if "maximum" in node else _number_value(node, "exclusiveMaximum")
    # A bound is only added where it cannot contradict the schema's own (a schema asking for huge
    # numbers keeps them).
    if "minimum" not in node and "exclusiveMinimum" not in node and (high is None or high >= -SAFE_INTEGER):
        node["minimum"] = -SAFE_INTEGER
    if "maximum" not in node and "exclusiveMaximum" not in node and (low is None or low <= SAFE_INTEGER):
        node["maximum"] = SAFE_INTEGER
    if "number" in kinds and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP
    return node
