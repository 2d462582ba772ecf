"""What gateways probe besides the OpenAI API: `GET /v1/loads` (and `/loads`), the worker's load
(app/loads.py), and `GET /server_info`, the serving facts SGLang answers there (the SGLang Model
Gateway asks for it when it registers a worker)."""
from __future__ import annotations

from litestar import Request, Response, get

from app.loads import LoadsResponse, ServerInfo
from app.openapi import api_operation
from app.protocol import encode
from app.routes_misc import package_version
from app.state import ServerState


@get(["/v1/loads", "/loads"], tags=["Operations"], summary="Worker load (SGLang's GetLoads shape)",
     operation_class=api_operation(response=LoadsResponse, errors=(503,), ok="Running and waiting requests, KV usage and capacity, "
                                   "generation throughput and prefix-cache hit rate, as SGLang's /v1/loads."))
async def loads(request: Request) -> Response:
    """Polled by the SGLang Model Gateway's load monitor; 503 until the model is loaded."""
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    report = state.loads.report(engine.stats() or {}, engine.model_info, engine.num_in_flight(), package_version())
    return Response(content=encode(report), media_type="application/json", status_code=200)


@get("/server_info", tags=["Operations"], summary="Serving facts (SGLang's /server_info)",
     operation_class=api_operation(response=ServerInfo, errors=(503,), ok="Model, served names, context length, KV capacity, limits."))
async def server_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    info = state.require_engine().model_info
    body = ServerInfo(
        model_path=info.model_path, served_model_name=state.model_names[0], served_model_names=list(state.model_names),
        architecture=info.architecture, dtype=info.dtype, device=info.device, context_length=info.max_model_len,
        max_model_len=info.max_model_len, page_size=info.block_size, max_total_num_tokens=info.kv_cache_tokens,
        max_running_requests=info.max_num_seqs, version=package_version(),
    )
    return Response(content=encode(body), media_type="application/json", status_code=200)


LOADS_ROUTES = [loads, server_info]
