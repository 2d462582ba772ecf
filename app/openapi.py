"""OpenAPI for routes that decode their own bodies (strictly, with msgspec): the request schema comes
from msgspec.json.schema, inlined (our request types are not recursive), and is attached to the
operation as its request body."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def request_schema(kind: type) -> dict[str, Any]:
    schema = msgspec.json.schema(kind)
    return _inline(schema, schema.get("$defs", {}))


def body_operation(kind: type) -> type[Operation]:
    """An Operation class whose request body is `kind`'s schema (the handler reads the raw body)."""
    schema = request_schema(kind)

    @dataclass
    class _BodyOperation(Operation):
        def __post_init__(self) -> None:
            if self.request_body is None:
                self.request_body = RequestBody(
                    content={"application/json": OpenAPIMediaType(schema=schema)},  # type: ignore[arg-type]
                    required=True,
                )

    _BodyOperation.__name__ = f"{kind.__name__}Operation"
    return _BodyOperation


def openapi_config(version: str) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="prefixserve", version=version, path="/schema",
        description="OpenAI-compatible API of prefixserve (plus vLLM's /tokenize, /detokenize, /version).",
    )
