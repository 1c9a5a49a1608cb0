"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`.

Every failure path of the server ends here, so clients (the official SDKs included) can
parse all of them the same way: bad input is a 4xx with the parameter named, overload and
draining are 429/503 with a hint when to retry, and only a bug is a 500.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Callable, Coroutine, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"


class APIError(Exception):
    """An error answered to the client as-is (status, message, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_from_message(message: str) -> Optional[str]:
    """SamplingParams and the engine name the parameter first ("top_p must be ..."); surface it."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() and " must " in message else None


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """A body's validation errors (FastAPI's or pydantic's `.errors()`) as one message and the
    parameter it names."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and first.get("type") == "missing":
        return "request body is missing", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "request body must be a JSON object (sent with Content-Type: application/json)", None
    # Union members add their type names to the location ("prompt.str"); keep the field path.
    path = _field_path(loc)
    if len(errors) > 1 and _is_union_error(errors):
        # Every member of the union failed: the parameter is the field, the message the member
        # that matched furthest (a text part's invalid text, not "should be a valid string").
        deepest = max(errors, key=lambda e: len(e.get("loc", ())))
        where = _field_path([str(p) for p in deepest.get("loc", ()) if p != "body"])
        return (f"{where}: {deepest.get('msg')}" if where else str(deepest.get("msg"))), (path or None)
    message = f"{path}: {first.get('msg')}" if path else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, (path or None)


def _field_path(loc: list[str]) -> str:
    return ".".join(p for p in loc if not _is_type_name(p))


def _is_type_name(part: str) -> bool:
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict"} or part.startswith(("function-", "json-"))


def _is_union_error(errors: list[dict]) -> bool:
    roots = {tuple(e.get("loc", ()))[:2] for e in errors}
    return len(roots) == 1


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type FastAPI can raise into the OpenAI error schema."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            message, code = f"method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        elif exc.status_code == 400 and exc.detail == _FASTAPI_BODY_PARSE_ERROR:
            # FastAPI's answer when the JSON decoder itself fails (e.g. nesting past its recursion limit)
            message, code = "request body is not valid JSON (malformed, or nested too deeply)", "invalid_json"
        else:
            message, code = str(exc.detail), None
        return error_response(APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None) or f"err-{uuid.uuid4().hex[:12]}"
        logger.exception("unexpected error in %s %s (request %s)", request.method, request.url.path, request_id)
        return error_response(APIError(500, f"internal server error (request {request_id})", code="internal_error"))


STATUS_CLIENT_GONE = 499  # nginx's convention for "client closed the request" (logged; nobody reads it)


class GuardedRoute(APIRoute):
    """Answers an unexpected exception with a logged 500 in the OpenAI schema, naming the
    request id, instead of letting it escape to the server's default error page; a client
    that left while its body was being read is a 499, not an error."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except ClientDisconnect:
                return Response(status_code=STATUS_CLIENT_GONE)
            except Exception:
                request_id = getattr(request.state, "request_id", None) or f"req-{uuid.uuid4().hex[:12]}"
                logger.exception("unexpected error in %s %s (request %s)", request.method, request.url.path,
                                 request_id)
                return error_response(APIError(500, f"internal server error (request {request_id})",
                                               code="internal_error"))

        return guarded
