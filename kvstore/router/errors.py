"""Why the router refuses or fails a request, each with the HTTP status it answers with.

These are HTTP answers to an engine's client, not Strata RPC errors, so they
form their own small tree; the server turns each into an OpenAI-style error
body (``{"error": {"message", "type", "code"}}``)::

    RequestRefused                 the router answers instead of an engine
    ├── BadRequest          400    malformed JSON, a body that is not an object, no prompt, a body that
    │                              does not decode
    ├── NotFound            404    a path the router does not serve
    ├── MethodNotAllowed    405    a method the path does not take (Allow)
    ├── BodyTimeout         408    the body did not arrive whole within --body-timeout-seconds
    ├── BodyTooLarge        413    a body over --max-body-bytes
    ├── TooManyRequests     429    --max-in-flight requests already outstanding, or --max-body-reads
    │                              bodies already arriving (Retry-After)
    ├── ClientClosed        499    the client went away before its body was whole (nginx's code: no one
    │                              reads the answer, it is counted apart from the router's own failures)
    └── UpstreamFailed             no engine answered
        ├── NoEndpoint      503    every endpoint is out of rotation (Retry-After)
        ├── UpstreamUnreachable 502  the chosen engines refused the connection (retries spent)
        └── UpstreamTimeout 504    the engine sent no response headers within the upstream timeout
"""

from __future__ import annotations


class RequestRefused(Exception):
    status = 500
    kind = "server_error"

    body_unread = False  # the answer comes before the client's body was read: close the connection after it

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class BadRequest(RequestRefused):
    status = 400
    kind = "invalid_request_error"


class NotFound(RequestRefused):
    status = 404
    kind = "invalid_request_error"


class MethodNotAllowed(RequestRefused):
    status = 405
    kind = "invalid_request_error"


class BodyTimeout(RequestRefused):
    status = 408
    kind = "invalid_request_error"
    body_unread = True


class BodyTooLarge(RequestRefused):
    status = 413
    kind = "invalid_request_error"
    body_unread = True


class TooManyRequests(RequestRefused):
    status = 429
    kind = "rate_limit_error"


class ClientClosed(RequestRefused):
    status = 499
    kind = "invalid_request_error"


class UpstreamFailed(RequestRefused):
    status = 502
    kind = "upstream_error"


class NoEndpoint(UpstreamFailed):
    status = 503


class UpstreamUnreachable(UpstreamFailed):
    status = 502


class UpstreamTimeout(UpstreamFailed):
    status = 504
