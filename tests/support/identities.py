"""The suite's tenants: three bearer tokens and the policy file that grants them namespaces, a raw
gRPC stub that carries one, and a call run as another local uid (peer credentials on the
same-host socket).

team-a may use ``a`` and ``a-*``, team-b (granted by the token's SHA-256) ``b``, admin every
namespace.
"""

from __future__ import annotations

import hashlib
import os
import textwrap

from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth.credentials import ChannelSecurity
from kvstore.client.codec import CHANNEL_OPTIONS

TOKEN_A = "tok-team-a-0123456789abcdef"
TOKEN_B = "tok-team-b-0123456789abcdef"
TOKEN_ADMIN = "tok-admin-0123456789abcdef"


def policy_text(*extra: str) -> str:
    return textwrap.dedent(f"""
        [[token]]
        name = "team-a"
        token = "{TOKEN_A}"
        namespaces = ["a", "a-*"]

        [[token]]
        name = "team-b"
        token_sha256 = "{hashlib.sha256(TOKEN_B.encode()).hexdigest()}"
        namespaces = ["b"]

        [[token]]
        name = "admin"
        token = "{TOKEN_ADMIN}"
        namespaces = ["*"]
        """) + "\n".join(extra)


def raw_stub(target: str, token: str | None = None) -> kv_pb2_grpc.KVServiceStub:
    return kv_pb2_grpc.KVServiceStub(ChannelSecurity.build(token=token).channel(target, CHANNEL_OPTIONS))


def as_uid(uid: int, fn) -> str:
    """Run ``fn`` in a forked child that setuid()s to ``uid``; its result (a short string) or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            if uid != os.getuid():
                os.setgid(65534)
                os.setuid(uid)
            out = fn()
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            out = f"{type(err).__name__}: {err}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out
