"""The one place Strata errors become gRPC statuses, and back.

Each status code means one thing: bad input INVALID_ARGUMENT, an unknown
namespace NOT_FOUND, missing or unknown credentials UNAUTHENTICATED, an
identity not allowed a namespace PERMISSION_DENIED, a lease or slot that is no longer valid
FAILED_PRECONDITION, full or overloaded RESOURCE_EXHAUSTED (with a
``google.rpc.RetryInfo`` delay), a checksum mismatch DATA_LOSS, a failed
device UNAVAILABLE. The exact error class travels as ``google.rpc.ErrorInfo``
(domain ``strata``) so a client re-raises the same class the server raised,
wherever in the tree it is defined (``errors.DEFINED_ELSEWHERE``); a name it
does not know falls back to the class its status code stands for.

The message travels twice, both times in the answer's trailing metadata:
as ``grpc-message`` (percent-encoded, up to three bytes per byte) and inside
``grpc-status-details-bin`` (base64, four bytes per three). A client refuses
trailers past its metadata limit (8 KiB soft, 16 KiB hard by default) with
RESOURCE_EXHAUSTED, which would read as "retry later" for what may be bad
input. So a status carries at most :data:`MAX_MESSAGE_BYTES` of the message
(the rest is cut, and the cut says so): at worst 3 KiB + 1.4 KiB of
metadata. Errors quote bad input briefly in the first place; this is the
bound for any that does not.
"""

from __future__ import annotations

import importlib

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstore import errors

DOMAIN = "strata"
MAX_MESSAGE_BYTES = 1024  # of an error's message (UTF-8) a status carries

_CODES: list[tuple[type[errors.StrataError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnknownNamespace, grpc.StatusCode.NOT_FOUND),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.LeaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (errors.TierUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.IndexUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
]

_BY_NAME: dict[str, type[errors.StrataError]] = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, errors.StrataError)
}


def error_class(name: str) -> type[errors.StrataError] | None:
    """The StrataError subclass called ``name``, importing its module if it lives outside
    ``kvstore.errors``; None for a name outside the tree (a newer server's error)."""
    cls = _BY_NAME.get(name)
    if cls is None and name in errors.DEFINED_ELSEWHERE:
        found = getattr(importlib.import_module(errors.DEFINED_ELSEWHERE[name]), name, None)
        if isinstance(found, type) and issubclass(found, errors.StrataError):
            cls = _BY_NAME[name] = found
    return cls


def _rebuild(cls: type[errors.StrataError], message: str, retry_after_s: float | None) -> errors.StrataError:
    """An instance of ``cls`` carrying the server's message. A subclass's own constructor
    may take other arguments (MalformedEvent's reason), so it is bypassed: what crosses the
    wire is the class, the message and, for ResourceExhausted, the retry delay."""
    err = cls.__new__(cls)
    errors.StrataError.__init__(err, message)
    if isinstance(err, errors.ResourceExhausted):
        err.retry_after_s = retry_after_s if retry_after_s is not None else 0.1
    return err


_FALLBACK_BY_CODE = {code: cls for cls, code in _CODES}
_FALLBACK_BY_CODE[grpc.StatusCode.UNAVAILABLE] = errors.DaemonUnavailable


def code_for(err: errors.StrataError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(err, cls):
            return code
    return grpc.StatusCode.INTERNAL


def to_status(err: errors.StrataError) -> grpc.Status:
    code = code_for(err)
    details = []
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=type(err).__name__, domain=DOMAIN))
    details.append(info)
    if isinstance(err, errors.ResourceExhausted):
        retry = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, int(err.retry_after_s * 1000)))
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=bounded(str(err)), details=details)
    return rpc_status.to_status(status)


def bounded(message: str) -> str:
    """``message`` as a status carries it: valid UTF-8 (a lone surrogate becomes "?"), at most
    :data:`MAX_MESSAGE_BYTES` bytes, the cut marked with the length of the whole."""
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_MESSAGE_BYTES:
        return data.decode("utf-8")
    marker = f"… (cut: {len(data)} bytes in all)"
    head = data[: MAX_MESSAGE_BYTES - len(marker.encode())].decode("utf-8", "ignore")  # "ignore": a split character
    return head + marker


def from_rpc_error(err: grpc.RpcError) -> errors.StrataError:
    """The Strata error a failed call stands for (client side)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = err.details() if hasattr(err, "details") else str(err)
    cls: type[errors.StrataError] | None = None
    retry_after = None
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN:
                    cls = error_class(info.reason)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.ToMilliseconds() / 1000
    if cls is None:
        cls = _FALLBACK_BY_CODE.get(code)
    if cls is None:
        return errors.StrataError(f"{code.name}: {message}")
    if cls is errors.DaemonUnavailable or (
        code is grpc.StatusCode.UNAVAILABLE and not issubclass(cls, (errors.TierUnavailable, errors.IndexUnavailable))
    ):
        return errors.DaemonUnavailable(f"strata daemon unavailable: {message}")
    return _rebuild(cls, message, retry_after)
