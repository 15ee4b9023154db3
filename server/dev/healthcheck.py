"""Container health probe: `python -m server.dev.healthcheck --url URL [--ca --cert --key]`.

Exit 0 when the URL answers 200, else 1, as Docker's HEALTHCHECK and exec probes expect. Speaks
mutual TLS to the management listener with a mounted client certificate. Standard library only,
so a probe costs a fraction of a second and never imports the engine.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

OK = 200


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llm-gateway-healthcheck", description=__doc__)
    parser.add_argument("--url", default="https://127.0.0.1:1026/v2/health/live")
    parser.add_argument("--ca", help="CA bundle that signed the gateway's certificate")
    parser.add_argument("--cert", help="client certificate (management listener mTLS)")
    parser.add_argument("--key", help="client key")
    parser.add_argument("--timeout", type=float, default=5.0)
    return parser.parse_args(argv)


def tls_context(args: argparse.Namespace) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=args.ca)
    context.check_hostname = False  # the probe dials 127.0.0.1; the chain is still verified
    if args.cert:
        context.load_cert_chain(args.cert, args.key)
    return context


def probe(args: argparse.Namespace) -> int:
    context = tls_context(args) if args.url.startswith("https:") else None
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout, context=context) as response:
            status: int = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ssl.SSLError) as exc:
        sys.stderr.write(f"healthcheck: {args.url}: {exc}\n")
        return 1
    if status != OK:
        sys.stderr.write(f"healthcheck: {args.url}: HTTP {status}\n")
    return 0 if status == OK else 1


def main(argv: Sequence[str] | None = None) -> int:
    return probe(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
