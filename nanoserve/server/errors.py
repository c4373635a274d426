"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status.

Every error the server returns goes through here, so clients built for OpenAI (whose SDK raises
BadRequestError, NotFoundError, RateLimitError ... by status) see what they expect.
"""

import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The other 4xx are "invalid_request_error" and the other 5xx "internal_server_error" (error_type).
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def to_dict(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=headers)


def error_type(status: int) -> str:
    return _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "internal_server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code or str(status)}}


def bad_request(exc: ValueError) -> APIError:
    """A ValueError raised by the engine or SamplingParams ("field: rule, got value") as a 400."""
    message = str(exc)
    match = re.match(r"([A-Za-z_][\w.]*): ", message)
    return APIError(400, message, match.group(1) if match else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI's API (and its clients) expect 400 naming the field.
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc holds the character offset, not a field
            reason = first.get("ctx", {}).get("error", "")
            offset = first.get("loc", (None, None))[-1]
            return APIError(400, f"the request body is not valid JSON: {reason} at character {offset}").response()
        content_type = request.headers.get("content-type")
        whole_body = tuple(first.get("loc", ())) == ("body",)  # not one field of it
        if whole_body and not _is_json(content_type):
            # FastAPI parses a body as JSON only under a JSON content type (curl -d sends a form's); the bytes
            # then fail as "Input should be a valid dictionary", which does not say what to change.
            got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return APIError(400, f"the request body must be JSON, sent with Content-Type: application/json "
                                 f"(got {got})").response()
        if whole_body and first.get("type") == "missing":
            return APIError(400, "the request body is empty: send a JSON object").response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # Union members add their type name to the path ("prompt.str"); the field is what matters.
        param = ".".join(p for p in loc if not _looks_like_type(p)) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return APIError(400, f"{param}: {message}" if param else message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            message += f" (allowed: {exc.headers['Allow']})"
        return APIError(exc.status_code, message).response(exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _looks_like_type(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[")) or part[0].isupper()
