"""`scaletrain certs` and `scaletrain token`: a development CA and certificates, and tokens whose
hashes a tokens file keeps."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser("certs", help="write a development CA and certificates signed by it")
    certs.set_defaults(handler=_certs)
    certs.add_argument("dir", type=Path, help="where to write ca.pem, server.*, client.*")
    certs.add_argument(
        "--host", action="append", default=[], help="another name of the server (repeatable)"
    )
    token = sub.add_parser("token", help="mint a token; only its hash is kept in the tokens file")
    token.set_defaults(handler=_token)
    token.add_argument("--tokens", type=Path, required=True, help="the tokens file (JSON)")
    token.add_argument(
        "--role",
        choices=("reader", "trainer", "admin"),
        required=True,
        help="reader reads checkpoints, trainer also writes checkpoints and telemetry, admin "
        "also deletes; each within --run",
    )
    token.add_argument("--run", default="*", help="the run it is good for (default: every run)")
    token.add_argument("--name", default="", help="a label for audit lines")


def _certs(args: argparse.Namespace) -> int:
    from scaletrain import security

    files = security.generate_certs(args.dir, tuple(args.host))
    print(f"wrote a development CA and certificates to {files.root}")
    print(f"serve and connect with TLS: export {security.TLS_DIR_ENV}={files.root.resolve()}")
    print(f"require client certificates too: export {security.TLS_CLIENT_AUTH_ENV}=1")
    return 0


def _token(args: argparse.Namespace) -> int:
    from scaletrain import security

    if args.run != security.ALL_RUNS:
        from ckptd.names import check_run

        check_run(args.run)
    # The token goes to stdout alone (for `export SCALETRAIN_TOKEN=$(scaletrain token ...)`);
    # the file keeps its hash.
    print(security.add_token(args.tokens, args.role, args.run, args.name))
    return 0
