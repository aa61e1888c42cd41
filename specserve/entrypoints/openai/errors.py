"""Errors in OpenAI's format, ``{"error": {"message", "type", "param", "code"}}``, and the app's
exception handlers that answer every failure (ours, pydantic's, Starlette's, unexpected) with one."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.entrypoints.openai.protocol import ErrorResponse

logger = logging.getLogger(__name__)

# the error answers the generation routes document in the OpenAPI schema
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameters or prompt too long"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "Waiting queue full, or the engine stopped"},
}


class APIError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The error object: a response's body, or a stream's error event."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# pydantic names the member of a union it tried in an error's location ("stop.str", "stop.list[str]")
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _most_specific_error(errs: list[dict]) -> dict:
    """Of a union field's errors, the one for the member the input's type matches (a list given
    for ``str | list[str]`` is reported against the list's rule, e.g. its length), else the first."""
    first = errs[0] if errs else {}
    field = next((x for x in first.get("loc", ()) if x != "body"), None)
    value = first.get("input")
    if isinstance(value, list):
        for e in errs:
            loc = [x for x in e.get("loc", ()) if x != "body"]
            if loc[:1] == [field] and any(isinstance(x, str) and x.startswith("list[") for x in loc):
                return e
    return first


async def _api_error(_: Request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param, e.code)


async def _validation_error(_: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), (bytes, str)):
        return error_response(400, "the request body must be a JSON object sent with "
                                   "'Content-Type: application/json'")
    if first.get("type") == "json_invalid":
        pos = first.get("loc", (None, None))[-1]
        return error_response(400, f"the request body is not valid JSON "
                                   f"({first.get('ctx', {}).get('error', 'invalid')} at character {pos})")
    first = _most_specific_error(errs)
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and x not in _UNION_TAGS
                   and not (isinstance(x, str) and "[" in x))
    value = first.get("input")
    shown = repr(value)[:120] if not isinstance(value, dict) else "an object"
    msg = f"{loc or 'body'}: {first.get('msg', 'invalid')} (got {shown})"
    if len(errs) > 1:
        msg += f"; and {len(errs) - 1} more error(s)"
    return error_response(400, msg, param=loc or None)


async def _http_error(_: Request, e: StarletteHTTPException):
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), type_)


async def _internal_error(_: Request, e: Exception):
    logger.exception("internal error")
    return error_response(500, f"internal error: {type(e).__name__}", "internal_error")


def add_error_handlers(app: FastAPI) -> None:
    """Answer our errors, invalid bodies, unknown routes and unexpected exceptions in OpenAI's format."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
