"""ServerState: everything one app instance knows (held in `app.state.server`; nothing global)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.errors import OpenAIError
from app.loads import LoadReporter
from app.metrics import ServerMetrics
from app.responses_store import ResponseStore
from engine.async_engine import AsyncEngine
from engine.tool_calls import ToolChat

RETRY_AFTER_S = "1"


@dataclass(eq=False)
class ServerState:
    engine: AsyncEngine | None
    model_names: tuple[str, ...]
    api_key: str | None
    max_waiting_requests: int
    metrics: ServerMetrics
    # --max-queued-requests: a generation request arriving while this many wait in the engine is refused
    # (503 / Anthropic's 529, app/errors.py); None: no limit.
    max_queued_requests: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    load_error: str | None = None
    # Stored /v1/responses results (previous_response_id, GET /v1/responses/{id}); per process.
    responses: ResponseStore = field(default_factory=ResponseStore)
    loads: LoadReporter = field(default_factory=LoadReporter)  # GET /v1/loads (app/routes_loads.py)
    # The engine's chat template with tool calling: built once (it probes the template), not per request.
    tool_chat: ToolChat | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.engine is not None:
            self.attach(self.engine)

    # -- readiness ------------------------------------------------------------------------
    def attach(self, engine: AsyncEngine) -> None:
        """The engine finished loading (serve() builds it after the port is open)."""
        self.engine = engine
        self.tool_chat = engine.tool_chat
        self.metrics.bind_model(engine.model_info.max_model_len)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.engine.is_dead and not self.draining

    def not_ready_reason(self) -> str:
        if self.draining:
            return "The server is shutting down."
        if self.load_error is not None:
            return f"The model failed to load: {self.load_error}"
        if self.engine is None:
            return "The model is still loading."
        return "The engine is not running."

    def require_engine(self) -> AsyncEngine:
        if not self.ready:
            raise OpenAIError(503, self.not_ready_reason(), headers={"Retry-After": RETRY_AFTER_S})
        return self.engine

    # -- requests -------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The served name a request addressed (404 for a model we do not serve)."""
        if requested is None or requested == "":
            return self.model_names[0]
        if requested not in self.model_names:
            raise OpenAIError(404, f"The model `{requested}` does not exist. Available: "
                              f"{', '.join(self.model_names)}.", param="model", code="model_not_found")
        return requested

    def admit(self, engine: AsyncEngine, count: int) -> None:
        """Refuse work beyond what the engine can run plus --max-waiting-requests (429 + Retry-After).
        Call right before submitting (no await in between): the engine counts requests it was given."""
        capacity = engine.model_info.max_num_seqs + self.max_waiting_requests
        if engine.num_in_flight() + count > capacity:
            raise OpenAIError(
                429, f"The server is overloaded ({engine.num_in_flight()} requests in flight, limit {capacity}); "
                "retry later.", headers={"Retry-After": RETRY_AFTER_S},
            )
