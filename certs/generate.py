"""Generate development TLS material for the llm-gateway (never for production).

Run ``python certs/generate.py [--out certs] [--force]``.  Without ``--force`` the
script does nothing when every output file already exists.  Everything is
produced with the ``cryptography`` package; no ``openssl`` binary is needed.

Files written (all keys RSA-3072, all signatures SHA-256, keys mode 0600):

* ``ca.pem``                          dev CA certificate (trust anchor)
* ``server.pem`` / ``server.key``     server cert for DNS ``localhost`` + IP ``127.0.0.1``
* ``server-encrypted.key``            the server key, encrypted (PKCS#8, best available)
* ``server-key-password.txt``         the password for ``server-encrypted.key``
* ``client.pem`` / ``client.key``     valid client certificate (clientAuth)
* ``revoked-client.pem`` / ``.key``   client certificate listed in ``crl.pem``
* ``crl.pem``                         CRL issued by the dev CA
* ``expired-client.pem`` / ``.key``   client certificate whose validity ended
* ``rogue-ca.pem``                    an unrelated CA (not trusted by the gateway)
* ``rogue-client.pem`` / ``.key``     client certificate signed by the rogue CA
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KEY_SIZE = 3072
VALIDITY = dt.timedelta(days=825)

OUTPUT_FILES: tuple[str, ...] = (
    "ca.pem",
    "server.pem",
    "server.key",
    "server-encrypted.key",
    "server-key-password.txt",
    "client.pem",
    "client.key",
    "revoked-client.pem",
    "revoked-client.key",
    "crl.pem",
    "expired-client.pem",
    "expired-client.key",
    "rogue-ca.pem",
    "rogue-client.pem",
    "rogue-client.key",
)


@dataclass(frozen=True)
class Issuer:
    """A CA certificate together with its private key."""

    cert: x509.Certificate
    key: rsa.RSAPrivateKey


@dataclass(frozen=True)
class Leaf:
    """An end-entity certificate together with its private key."""

    cert: x509.Certificate
    key: rsa.RSAPrivateKey


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=KEY_SIZE)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llm-gateway dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def make_ca(common_name: str) -> Issuer:
    """Create a self-signed CA certificate valid from one day ago."""
    key = _new_key()
    name = _name(common_name)
    start = _now() - dt.timedelta(days=1)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issuer(cert=cert, key=key)


def _leaf_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=True,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def make_leaf(
    issuer: Issuer,
    common_name: str,
    eku: x509.ObjectIdentifier,
    *,
    san: list[x509.GeneralName] | None = None,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> Leaf:
    """Create an end-entity certificate signed by ``issuer``."""
    key = _new_key()
    start = not_before if not_before is not None else _now() - dt.timedelta(days=1)
    end = not_after if not_after is not None else start + VALIDITY
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_key_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer.key, hashes.SHA256())
    return Leaf(cert=cert, key=key)


def make_crl(issuer: Issuer, revoked: list[x509.Certificate]) -> x509.CertificateRevocationList:
    """Create a CRL from ``issuer`` that lists every certificate in ``revoked``."""
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(now + dt.timedelta(days=365))
        .add_extension(x509.CRLNumber(1), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
    )
    for cert in revoked:
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(cert.serial_number)
            .revocation_date(now - dt.timedelta(minutes=5))
            .add_extension(x509.CRLReason(x509.ReasonFlags.key_compromise), critical=False)
            .build()
        )
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(issuer.key, hashes.SHA256())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: rsa.RSAPrivateKey, password: bytes | None = None) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password is not None
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    """Write ``data`` atomically; secrets are created with mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    mode = 0o600 if secret else 0o644
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _all_present(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in OUTPUT_FILES)


def _build_files() -> dict[str, tuple[bytes, bool]]:
    """Build every artefact in memory: file name -> (content, is_secret)."""
    ca = make_ca("llm-gateway dev CA")
    localhost = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = make_leaf(ca, "localhost", ExtendedKeyUsageOID.SERVER_AUTH, san=localhost)
    client = make_leaf(ca, "dev-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    revoked = make_leaf(ca, "revoked-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    past = _now() - dt.timedelta(days=30)
    expired = make_leaf(
        ca,
        "expired-client",
        ExtendedKeyUsageOID.CLIENT_AUTH,
        not_before=past,
        not_after=past + dt.timedelta(days=1),
    )
    rogue_ca = make_ca("llm-gateway ROGUE CA")
    rogue = make_leaf(rogue_ca, "rogue-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    crl = make_crl(ca, [revoked.cert])
    password = secrets.token_urlsafe(24)
    return {
        "ca.pem": (_cert_pem(ca.cert), False),
        "server.pem": (_cert_pem(server.cert), False),
        "server.key": (_key_pem(server.key), True),
        "server-encrypted.key": (_key_pem(server.key, password.encode()), True),
        "server-key-password.txt": (password.encode() + b"\n", True),
        "client.pem": (_cert_pem(client.cert), False),
        "client.key": (_key_pem(client.key), True),
        "revoked-client.pem": (_cert_pem(revoked.cert), False),
        "revoked-client.key": (_key_pem(revoked.key), True),
        "crl.pem": (crl.public_bytes(serialization.Encoding.PEM), False),
        "expired-client.pem": (_cert_pem(expired.cert), False),
        "expired-client.key": (_key_pem(expired.key), True),
        "rogue-ca.pem": (_cert_pem(rogue_ca.cert), False),
        "rogue-client.pem": (_cert_pem(rogue.cert), False),
        "rogue-client.key": (_key_pem(rogue.key), True),
    }


def generate(out_dir: Path, force: bool = False) -> None:
    """Create the dev TLS material in ``out_dir`` unless it is already complete."""
    out_dir = Path(out_dir)
    if not force and _all_present(out_dir):
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _build_files()
    for name in OUTPUT_FILES:
        content, secret = files[name]
        _write(out_dir / name, content, secret=secret)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="output directory (default: the directory holding this script)",
    )
    parser.add_argument("--force", action="store_true", help="regenerate even if present")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = _parse_args(argv)
    out_dir: Path = args.out
    existed = _all_present(out_dir)
    generate(out_dir, force=args.force)
    state = "unchanged (use --force to regenerate)" if existed and not args.force else "written"
    sys.stdout.write(f"dev TLS material in {out_dir}: {state}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
