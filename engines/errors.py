"""Exceptions the engine raises; the API layer maps InvalidRequestError to HTTP 400."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request is malformed or impossible to serve; nothing in the engine was changed.

    `param` names the offending request field (OpenAI's error body carries it) and `code` is a
    short machine-readable reason.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt (plus requested completion) does not fit the model's context or the KV cache."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class CacheCapacityError(RuntimeError):
    """Not enough free KV blocks right now (the scheduler waits or preempts; never user-facing)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped because of an internal fault; requests cannot be served."""
