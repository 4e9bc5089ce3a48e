"""Errors as OpenAI's API gives them: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``, which
the ``openai`` client turns into its own exception classes (BadRequestError, AuthenticationError, NotFoundError,
RateLimitError, InternalServerError, APIError for an error event inside a stream). Each error also names the metrics'
outcome label it counts under."""

from __future__ import annotations

import json
from dataclasses import dataclass

from swarm.errors import BadInputError, SwarmError


@dataclass  # not frozen: the web framework sets an exception's __traceback__
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    outcome: str = "bad_request"  # the metrics' label (swarm.metrics)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event(self) -> str:
        """The server-sent event that ends a stream which failed after it started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "invalid or missing API key: send 'Authorization: Bearer KEY'",
        code="invalid_api_key",
        outcome="unauthorized",
    )


def unknown_model(name: str, known: list[str]) -> ApiError:
    shown = ", ".join(known) or "none"
    return ApiError(
        404,
        f"the model {name!r} does not exist here (served: {shown})",
        code="model_not_found",
        param="model",
        outcome="not_found",
    )


def context_too_long(prompt: int, wanted: int, limit: int) -> ApiError:
    return ApiError(
        400,
        f"this model's context is {limit} tokens; the prompt has {prompt} and {wanted} more were "
        "asked for: shorten the prompt or lower max_tokens",
        code="context_length_exceeded",
        param="messages",
        outcome="context_too_long",
    )


def too_many(message: str) -> ApiError:
    return ApiError(429, message, type="rate_limit_exceeded", code="rate_limit_exceeded", outcome="too_many")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="swarm_unavailable", outcome="unavailable")


def from_swarm(e: Exception) -> ApiError:
    """A failure of the swarm (after the client's own retries) as the caller sees it."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BadInputError):
        return bad_request(str(e))
    if isinstance(e, SwarmError):
        return unavailable(f"the swarm could not finish this request: {e}")
    return ApiError(
        500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error", outcome="error"
    )
