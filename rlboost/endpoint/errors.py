"""What the endpoint answers when it refuses a call: an OpenAI error object with its HTTP status."""

from __future__ import annotations

from rlboost.errors import RlboostError


class EndpointError(RlboostError, ValueError):
    """A call the endpoint refuses, with the HTTP status and the OpenAI error type to answer."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def bad(message: str, param: str | None = None) -> EndpointError:
    return EndpointError(message, 400, param)
