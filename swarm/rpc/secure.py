"""The direct data plane's security: TLS 1.3 (Python's ``ssl``) for encryption, bound to both ends' libp2p
identities by signatures, so a direct connection is as safe across the internet as a libp2p stream.

Why not plain certificate verification: peers have no CA. Each server makes a throwaway self-signed certificate at
start; what makes it trustworthy is a signature of its fingerprint by the server's identity key (the key its peer id
is the hash of), sent as the first frame inside TLS. The client checks that signature against the peer id it meant
to dial, so an impostor at the address (a hijacked route, a stale or forged announcement pointing at someone else)
fails the handshake and the client falls back to libp2p.

The client proves its own identity the same way, in its first frame: its identity key signs the server
certificate's fingerprint and the server's peer id. That signature is useless anywhere else (only this server holds
the key of that certificate), so a server cannot replay it to impersonate the client elsewhere, and an observer
sees nothing (it travels inside TLS). The server then knows the caller's peer id as surely as over libp2p, and
per-caller limits, adapters and membership (``member``: a private swarm's token, see ``swarm.membership``) key on it.
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hivemind.utils.crypto import RSAPublicKey

from swarm.identity import Credentials, peer_id_of_key

_SERVER_TAG = b"swarm-direct-v1|server|"
_CLIENT_TAG = b"swarm-direct-v1|client|"


def client_proof(creds: Credentials, fingerprint: str, server: str) -> str:
    """This client's signature for a connection to ``server`` presenting certificate ``fingerprint``."""
    return creds.sign_once(_client_message(fingerprint, server))


def fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _client_message(fp: str, server: str) -> bytes:
    return _CLIENT_TAG + fp.encode() + b"|" + server.encode()


def _verified_author(public_key: str, message: bytes, signature: str) -> str | None:
    """The peer id of ``public_key`` if it signed ``message``; None for anything unreadable or forged."""
    try:
        key = public_key.encode()
        author = peer_id_of_key(key)
        valid = RSAPublicKey.from_bytes(key).verify(message, signature.encode())
    except (ValueError, TypeError):
        return None
    return author if valid else None


def server_author(public_key: str, signature: str, fp: str) -> str | None:
    """Who vouches for the server certificate ``fp`` (None: nobody)."""
    return _verified_author(public_key, _SERVER_TAG + fp.encode(), signature)


def client_author(public_key: str, signature: str, fp: str, server: str) -> str | None:
    """Who is calling, per its proof for this server's certificate (None: an unproven caller)."""
    return _verified_author(public_key, _client_message(fp, server), signature)


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS context and the signed binding of its certificate to its identity."""

    context: ssl.SSLContext
    fingerprint: str
    signature: str  # by the server's identity key, over the certificate's fingerprint


def server_tls(creds: Credentials) -> ServerTls:
    """A fresh self-signed certificate (EC P-256) and the context that serves it. ``ssl`` loads keys only from
    files, so they pass through a private temporary folder that is gone when this returns."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm peer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="swarm-tls-") as folder:
        cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.touch(mode=0o600)
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        context.load_cert_chain(cert_file, key_file)
    fp = fingerprint(cert.public_bytes(serialization.Encoding.DER))
    return ServerTls(context, fp, creds.sign(_SERVER_TAG + fp.encode()))


def client_context() -> ssl.SSLContext:
    """TLS 1.3 without CA checks: the server's identity is checked by its signed hello instead (see above)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
