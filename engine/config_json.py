"""Config dataclasses from the JSON text of their command-line flag (vLLM's `--kv-events-config '{...}'`,
`--speculative-config '{...}'`) or a dict, with errors that say what is wrong."""
from __future__ import annotations

import json
from dataclasses import fields

from engine.errors import InvalidConfigError


def json_object(value: dict | str, name: str) -> dict:
    """The dict itself, or the JSON object the text holds."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidConfigError(f"{name} must be a JSON object.")
    return value


def from_keys(cls, value: dict, name: str):
    """``cls(**value)``, naming unknown keys (and the known ones) first."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidConfigError(f"{name} has unknown keys {unknown}; known: {sorted(known)}.")
    return cls(**value)
