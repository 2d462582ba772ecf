"""`--api-key`: a guard for the API routes (health, metrics, version and the schema stay open)."""
from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from app.errors import OpenAIError


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    expected = connection.app.state.server.api_key
    if not expected:
        return
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        token = connection.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise OpenAIError(
            401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
            headers={"WWW-Authenticate": "Bearer"},
        )
