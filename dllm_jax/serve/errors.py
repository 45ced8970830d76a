"""Errors the server answers with, in OpenAI's error schema.

  {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

`APIError` carries the HTTP status and the body; `from_request_error` maps the engine's named
`RequestError`s (a request it refused or a row it failed) to the same schema.
"""

from __future__ import annotations

from dllm_jax.serving import requests as engine_errors


class APIError(Exception):
  """An HTTP error answer: status, OpenAI error body and extra headers (e.g. Retry-After)."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None, reason: str = "bad_request"):
    super().__init__(message)
    self.status, self.message, self.type = status, message, type
    self.param, self.code, self.headers = param, code, dict(headers or {})
    self.reason = reason  # the /metrics label of a refused request

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
  return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
  # Says nothing about the key that was sent, the routes or the models.
  return APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                  code="invalid_api_key", reason="unauthorized")


def timeout(seconds: float) -> APIError:
  return APIError(408, f"The request did not finish within the server's request timeout "
                  f"({seconds:g} s); its rows were cancelled. Ask for fewer tokens or retry.",
                  type="timeout_error", code="request_timeout", reason="timeout")


def from_request_error(error: BaseException, prompt_field: str) -> APIError:
  """The answer to a request the engine refused or failed (`Result.error`)."""
  message = str(error)
  if isinstance(error, engine_errors.UnknownMethodError):
    return APIError(404, message, param="model", code="model_not_found", reason="not_found")
  if isinstance(error, engine_errors.PromptTooLongError):
    return bad_request(message, prompt_field, "context_length_exceeded")
  if isinstance(error, (engine_errors.MaskInPromptError, engine_errors.InvalidPromptError)):
    return bad_request(message, prompt_field)
  if isinstance(error, engine_errors.BadOptionError):
    return bad_request(message, None)
  return APIError(500, f"The server failed to decode this request: {message}",
                  type="server_error", code="decode_failed", reason="server_error")
