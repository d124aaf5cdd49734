"""Authentication and authorization of every Strata RPC, as one gRPC server interceptor.

Per call, before the servicer runs (so before the store is touched): who
is calling (a bearer token in the ``authorization`` metadata, else the
client certificate mTLS verified, else nobody, which only a daemon without
authentication accepts), then whether that identity may do this method's
action on the request's namespace. Put's namespace arrives in its stream,
so each message naming one is checked as it is read, before its bytes are
kept. Methods without a namespace (Commit, Abort, Release, Unpin) name
slot and lease ids, which are bound to the owner that took them
(:func:`kvstore.auth.owner_of`). A method this table does not know is
refused: a new RPC is closed until someone decides its action.

Health and reflection are outside ``/strata.``: they stay open, so probes
work without credentials. The interceptor sits inside the admission
interceptor, which turns the refusals (Strata errors) into statuses.
"""

from __future__ import annotations

import grpc

from kvstore.auth.authority import Authority
from kvstore.auth.identity import READ, WRITE, Caller, Identity, reset_caller, set_caller

NODE_WIDE = "node"  # the answer covers the whole fleet (every namespace): admins only
from kvstore.block import validate_namespace
from kvstore.errors import PermissionDenied, Unauthenticated

_GUARDED_PREFIX = "/strata."
_BEARER = "bearer "

# Method → the action it needs on its request's namespace; None: it names no namespace.
ACTIONS: dict[str, str | None] = {
    "Put": WRITE, "Get": READ, "Exists": READ, "Delete": WRITE, "Pin": READ, "Place": READ, "List": READ, "Stats": READ,
    "Allocate": WRITE, "Lookup": READ, "Score": READ, "Holders": READ,
    "Commit": None, "Abort": None, "Release": None, "Unpin": None, "Attach": None,
    "Nodes": NODE_WIDE,
    # The prefill/decode handoff (handoff.proto): the id is the capability, the namespace is checked too.
    "OpenHandoff": WRITE, "HeartbeatHandoff": READ, "CompleteHandoff": WRITE, "PullHandoff": WRITE,
    "Replication": NODE_WIDE,
}


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, authority: Authority) -> None:
        self._authority = authority

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_GUARDED_PREFIX):
            return handler
        op = method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, op))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._unary_stream(handler.unary_stream, op))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._stream_unary(handler.stream_unary, op))
        return handler._replace(stream_stream=self._refused(op))

    # ---- identity ------------------------------------------------------------------

    def identify(self, context: grpc.ServicerContext) -> Identity:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                if not isinstance(value, str) or not value[: len(_BEARER)].lower() == _BEARER:
                    raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
                return self._authority.from_token(value[len(_BEARER):].strip())
        if self._authority.mtls:
            auth = context.auth_context() or {}
            subjects = [v.decode() for v in auth.get("x509_common_name", ())]
            subjects += [v.decode() for v in auth.get("x509_subject_alternative_name", ())]
            if subjects:
                return self._authority.from_certificate(subjects)
        return self._authority.anonymous()

    def _caller(self, op: str, request, context) -> Caller:
        action = ACTIONS.get(op, "unknown")
        identity = self.identify(context)
        if action == "unknown":
            raise PermissionDenied(f"{op}: this daemon's auth policy has no rule for this method; upgrade the daemon")
        if action == NODE_WIDE:
            self._authority.check_node(identity, f"{op} (the fleet's nodes and addresses)")
        elif action is not None and request is not None:
            self.check_request(identity, op, action, request.namespace)
        return Caller(identity, identity.principal if identity.authenticated else "conn:" + context.peer())

    def check_request(self, identity: Identity, op: str, action: str, namespace: str) -> None:
        if op == "Stats" and not namespace:
            self._authority.check_node(identity, "Stats without a namespace")
            return
        if op == "Put" and not namespace:
            return  # later messages of the stream; the first must name it (the servicer says so)
        validate_namespace(namespace)  # its syntax only: says nothing about other namespaces
        self._authority.check(identity, namespace, action)

    # ---- wrappers ------------------------------------------------------------------

    def _unary(self, behavior, op: str):
        def guarded(request, context):
            token = set_caller(self._caller(op, request, context))
            try:
                return behavior(request, context)
            finally:
                reset_caller(token)

        return guarded

    def _unary_stream(self, behavior, op: str):
        def guarded(request, context):
            self._caller(op, request, context)  # the check; a stream's generator may run on other threads
            return behavior(request, context)

        return guarded

    def _stream_unary(self, behavior, op: str):
        def guarded(requests, context):
            caller = self._caller(op, None, context)
            action = ACTIONS[op]

            def checked():
                for request in requests:
                    if request.namespace:
                        self.check_request(caller.identity, op, action, request.namespace)
                    yield request

            token = set_caller(caller)
            try:
                return behavior(checked(), context)
            finally:
                reset_caller(token)

        return guarded

    @staticmethod
    def _refused(op: str):
        def refused(requests, context):
            raise PermissionDenied(f"{op}: this daemon's auth policy has no rule for this method; upgrade the daemon")

        return refused
