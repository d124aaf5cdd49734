"""Why the router refuses or fails a request, each with the HTTP status it answers with.

These are HTTP answers to an engine's client, not Strata RPC errors, so they
form their own small tree; the server turns each into an OpenAI-style error
body (``{"error": {"message", "type", "code"}}``)::

    RequestRefused                 the router answers instead of an engine
    ├── BadRequest          400    malformed JSON, a body that is not an object, no prompt
    ├── BodyTooLarge        413    a body over --max-body-bytes
    ├── TooManyRequests     429    --max-in-flight requests already outstanding (Retry-After)
    └── UpstreamFailed             no engine answered
        ├── NoEndpoint      503    every endpoint is out of rotation (Retry-After)
        ├── UpstreamUnreachable 502  the chosen engines refused the connection (retries spent)
        └── UpstreamTimeout 504    the engine sent no response headers within the upstream timeout
"""

from __future__ import annotations


class RequestRefused(Exception):
    status = 500
    kind = "server_error"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BadRequest(RequestRefused):
    status = 400
    kind = "invalid_request_error"


class BodyTooLarge(RequestRefused):
    status = 413
    kind = "invalid_request_error"


class TooManyRequests(RequestRefused):
    status = 429
    kind = "rate_limit_error"


class UpstreamFailed(RequestRefused):
    status = 502
    kind = "upstream_error"


class NoEndpoint(UpstreamFailed):
    status = 503


class UpstreamUnreachable(UpstreamFailed):
    status = 502


class UpstreamTimeout(UpstreamFailed):
    status = 504
