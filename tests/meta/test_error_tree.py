"""The one error tree: every StrataError subclass in the codebase is drawn in kvstore.errors'
docstring, and each one crosses gRPC as itself."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

import kvstore
from kvstore import errors
from kvstore.metrics import StoreMetrics
from kvstore.rpc.status import from_rpc_error
from kvstore.server.admission import AdmissionInterceptor

# Importing every kvstore module takes vLLM's and LMCache's integrations with it: seconds at collection.
pytestmark = pytest.mark.slow

RAISE = "/strata.test.v1.Errors/Raise"


def every_strata_error() -> list[type[errors.StrataError]]:
    """Every subclass kvstore defines. Other packages built on kvstore (weightcache) draw their
    own tree in their own errors module, with their own test; which of them a test run happened
    to import first must not change this list."""
    for module in pkgutil.walk_packages(kvstore.__path__, "kvstore.", onerror=lambda name: None):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as err:
            # An integration whose host project (lmcache, vllm: an optional extra) is not
            # installed here; anything else missing is a real error.
            if not module.name.startswith("kvstore.integrations.") or (err.name or "").startswith("kvstore"):
                raise
    found, todo = [], [errors.StrataError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return [cls for cls in found if cls.__module__.split(".")[0] == "kvstore"]


ALL = every_strata_error()


def make(cls: type[errors.StrataError]) -> errors.StrataError:
    """An instance as the code that raises it would build it."""
    if issubclass(cls, errors.ResourceExhausted):
        return cls(f"{cls.__name__} from the server", retry_after_s=0.25)
    if cls.__name__ == "MalformedEvent":
        return cls("msgpack", f"{cls.__name__} from the server")
    return cls(f"{cls.__name__} from the server")


def test_every_subclass_is_in_the_tree_and_findable_by_name():
    tree = errors.__doc__.split("A cache miss")[0]
    drawn = re.findall(r"[├└]── (\w+)", tree)
    assert len(drawn) == len(set(drawn)), "a class is drawn twice"
    names = [cls.__name__ for cls in ALL]
    assert len(names) == len(set(names)), "two StrataError subclasses share a name; names travel over gRPC"
    assert sorted(drawn) == sorted(names), "the tree in kvstore/errors.py's docstring is not the set of classes"
    for cls in ALL:
        if cls.__module__ == "kvstore.errors":
            assert cls.__name__ not in errors.DEFINED_ELSEWHERE
        else:
            assert errors.DEFINED_ELSEWHERE.get(cls.__name__) == cls.__module__, f"{cls.__name__}: add it to DEFINED_ELSEWHERE"
    assert set(errors.DEFINED_ELSEWHERE) <= set(names)
    for cls in ALL:  # each is drawn under its parent
        parent = cls.__bases__[0]
        if parent is not errors.StrataError:
            line = next(i for i, l in enumerate(tree.splitlines()) if re.search(rf"── {cls.__name__}\b", l))
            above = [l for l in tree.splitlines()[:line] if re.search(r"── \w+", l)]
            indent = tree.splitlines()[line].index("──")
            owner = next(l for l in reversed(above) if l.index("──") < indent)
            assert f"── {parent.__name__} " in owner + " ", f"{cls.__name__} is not drawn under {parent.__name__}"


@pytest.fixture(scope="module")
def raising_server():
    """A real gRPC server whose one method raises the error named in the request, through
    the daemon's own admission interceptor (the path every Strata RPC takes)."""
    by_name = {cls.__name__: cls for cls in ALL}

    def raise_named(request: bytes, context) -> bytes:
        raise make(by_name[request.decode()])

    handler = grpc.method_handlers_generic_handler(
        "strata.test.v1.Errors", {"Raise": grpc.unary_unary_rpc_method_handler(raise_named)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2), interceptors=[AdmissionInterceptor(8, StoreMetrics())]
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel.unary_unary(RAISE)
    channel.close()
    server.stop(0)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_each_error_crosses_grpc_as_its_own_class(raising_server, cls):
    with pytest.raises(grpc.RpcError) as info:
        raising_server(cls.__name__.encode(), timeout=10)
    err = from_rpc_error(info.value)
    assert type(err) is cls
    assert f"{cls.__name__} from the server" in str(err)
    if issubclass(cls, errors.ResourceExhausted):
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.retry_after_s == pytest.approx(0.25)


@pytest.mark.system
def test_a_client_that_never_imported_the_defining_module_still_gets_the_class():
    names = sorted(errors.DEFINED_ELSEWHERE)
    script = (
        "import sys\n"
        "from kvstore.rpc.status import error_class\n"
        f"names = {names!r}\n"
        "assert not any(m in sys.modules for m in ('kvstore.server.daemon', 'kvstore.index.events', 'kvstore.index.event_format'))\n"
        "print(' '.join(f'{error_class(n).__module__}.{error_class(n).__name__}' for n in names))\n"
        "print(error_class('NotAStrataError'), error_class('Exception'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].split() == [f"{errors.DEFINED_ELSEWHERE[n]}.{n}" for n in names]
    assert out[1] == "None None"
