"""API docs that work offline: Swagger UI at /docs and the spec at /openapi.json (where vLLM serves
them), Redoc at /redoc and /schema (Litestar's own docs root, kept), with every script, stylesheet and
icon served by this server from the `openapi-ui-bundles` package instead of a CDN.

    /docs, /schema/swagger          Swagger UI
    /redoc, /schema, /schema/redoc  Redoc (no Google Fonts: the browser's own fonts)
    /openapi.json, /schema/openapi.json
    /docs/assets/<file>             the UI bundles' files (a fixed list)
"""
from __future__ import annotations

import pathlib

from litestar import Request, Response, get
from litestar.exceptions import NotFoundException
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin, RedocRenderPlugin, SwaggerRenderPlugin
from litestar.response import File
from openapi_ui_bundles import redoc as redoc_bundle
from openapi_ui_bundles import swagger_ui as swagger_bundle

ASSETS_PATH = "/docs/assets"
# Served name -> (file in the package, media type): only these, not the bundles' whole folders.
ASSETS: dict[str, tuple[pathlib.Path, str]] = {
    "swagger-ui-bundle.js": (swagger_bundle.static_path / "swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui-standalone-preset.js": (swagger_bundle.static_path / "swagger-ui-standalone-preset.js",
                                        "text/javascript"),
    "swagger-ui.css": (swagger_bundle.static_path / "swagger-ui.css", "text/css"),
    "favicon-32x32.png": (swagger_bundle.static_path / "favicon-32x32.png", "image/png"),
    "redoc.standalone.js": (redoc_bundle.static_path / "redoc.standalone.js", "text/javascript"),
}
_FAVICON = f"<link rel='icon' type='image/png' href='{ASSETS_PATH}/favicon-32x32.png'>"


def render_plugins() -> tuple[OpenAPIRenderPlugin, ...]:
    """Litestar's renderers with local asset URLs; the first one also answers the /schema root."""
    redoc = RedocRenderPlugin(js_url=f"{ASSETS_PATH}/redoc.standalone.js", google_fonts=False, path="/redoc",
                              favicon=_FAVICON)
    swagger = SwaggerRenderPlugin(
        js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js", css_url=f"{ASSETS_PATH}/swagger-ui.css",
        standalone_preset_js_url=f"{ASSETS_PATH}/swagger-ui-standalone-preset.js", path="/swagger", favicon=_FAVICON,
    )
    return redoc, swagger, JsonRenderPlugin()


def _render(request: Request, kind: type[OpenAPIRenderPlugin]) -> bytes:
    plugin = next(p for p in request.app.openapi_config.render_plugins if isinstance(p, kind))
    return plugin.render(request, request.app.openapi_schema.to_schema())


@get("/docs", include_in_schema=False, media_type="text/html", sync_to_thread=False)
def swagger_docs(request: Request) -> bytes:
    return _render(request, SwaggerRenderPlugin)


@get("/redoc", include_in_schema=False, media_type="text/html", sync_to_thread=False)
def redoc_docs(request: Request) -> bytes:
    return _render(request, RedocRenderPlugin)


@get("/openapi.json", include_in_schema=False, sync_to_thread=False)
def openapi_json(request: Request) -> Response:
    return Response(_render(request, JsonRenderPlugin), media_type="application/json")


@get(f"{ASSETS_PATH}/{{name:str}}", include_in_schema=False, sync_to_thread=False)
def docs_asset(name: str) -> File:
    if name not in ASSETS:
        raise NotFoundException(f"no docs asset {name!r}")
    path, media_type = ASSETS[name]
    # The files only change with the package: let browsers keep them for a day.
    return File(path, media_type=media_type, content_disposition_type="inline",
                headers={"Cache-Control": "public, max-age=86400"})


DOCS_ROUTES = [swagger_docs, redoc_docs, openapi_json, docs_asset]
