"""APIError: a refusal in OpenAI's error body, raised anywhere a request is handled (the app's
exception handler answers it; limits.BodyLimit raises it from the body it reads)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from kiln.runtime.server.protocol import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code),
                            status_code=self.status, headers=self.headers)
