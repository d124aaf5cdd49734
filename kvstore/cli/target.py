"""What the ``strata`` commands that talk to a daemon share: its address and credentials as flags,
the client they open, and keys given as text or hex."""

from __future__ import annotations

import argparse
import os

DEFAULT_TARGET = "127.0.0.1:50051"


def client_options() -> argparse.ArgumentParser:
    """The flags of a daemon's address and credentials, a parent parser (defaults read from the
    ``STRATA_*`` variables now, when the parser is built)."""
    client_opts = argparse.ArgumentParser(add_help=False)
    client_opts.add_argument("--target", default=os.environ.get("STRATA_TARGET", DEFAULT_TARGET),
                             help=f"daemon address host:port or unix:PATH [env STRATA_TARGET; default {DEFAULT_TARGET}]")
    client_opts.add_argument("--timeout", type=float, default=10.0, help="seconds per call [default 10]")
    client_opts.add_argument("--no-shm", action="store_true", help="stream bytes over gRPC even on the daemon's host")
    client_opts.add_argument("--token-file", default=os.environ.get("STRATA_TOKEN_FILE"), metavar="FILE",
                             help="bearer token for a daemon with --auth-file, first line of FILE "
                             "[env STRATA_TOKEN_FILE; or the token itself in STRATA_TOKEN]")
    client_opts.add_argument("--tls-ca", default=os.environ.get("STRATA_TLS_CA"), metavar="PEM",
                             help="verify the daemon's TLS certificate with this CA [env STRATA_TLS_CA]")
    client_opts.add_argument("--tls-cert", default=os.environ.get("STRATA_TLS_CERT"), metavar="PEM",
                             help="client certificate, for a daemon with --tls-client-ca (mTLS) [env STRATA_TLS_CERT]")
    client_opts.add_argument("--tls-key", default=os.environ.get("STRATA_TLS_KEY"), metavar="PEM",
                             help="private key of --tls-cert [env STRATA_TLS_KEY]")
    client_opts.add_argument("--tls-server-name", default=os.environ.get("STRATA_TLS_SERVER_NAME"), metavar="NAME",
                             help="name to verify in the daemon's certificate when --target is an address")
    return client_opts


def key_options() -> argparse.ArgumentParser:
    """``--hex``, for the commands that take block keys: a parent parser."""
    key_opts = argparse.ArgumentParser(add_help=False)
    key_opts.add_argument("--hex", action="store_true", help="keys are hex-encoded bytes, not text")
    return key_opts


def parse_key(args: argparse.Namespace, text: str) -> bytes:
    if args.hex:
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise SystemExit(f"strata: key {text!r} is not hex (drop --hex to use it as text)") from None
    return text.encode()


def open_client(args: argparse.Namespace):
    from kvstore.client.sync import Client

    token = os.environ.get("STRATA_TOKEN") if not args.token_file else None
    return Client(args.target, timeout=args.timeout, use_shm=False if args.no_shm else None,
                  token=token or None, token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                  tls_key=args.tls_key, tls_server_name=args.tls_server_name)


def show_key(args: argparse.Namespace, key: bytes) -> str:
    if args.hex:
        return key.hex()
    try:
        return key.decode()
    except UnicodeDecodeError:
        return "hex:" + key.hex()
