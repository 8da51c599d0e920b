"""How the node reaches the coordinator safely: HTTPS with a known CA, plain HTTP only nearby.

A node sends its bearer token with every request and learns the run's trust anchor (the
manifest key) at its first join, so a connection an attacker can read or change costs both.
Three rules, shared by ``sparseloco node``, ``doctor`` and ``export``:

- ``https://`` URLs are verified against the system's CA store, plus the file given with
  ``--ca-cert`` (``SPARSELOCO_NODE_CA_CERT``) for a run with its own CA or a self-signed
  certificate. The bundle is *added* to the system store, not put in its place, because the
  same HTTP session also fetches presigned URLs from the object store (AWS S3, R2...).
- plain ``http://`` is accepted to this machine (loopback: ``127.0.0.0/8``, ``::1``,
  ``localhost``) and otherwise refused unless ``--allow-insecure-http`` says the network
  in between is trusted (a private container network, a VPN): ``check_coordinator_url``.
- a certificate that does not verify is not an outage: waiting will not fix it, and going on
  could mean talking to an impostor. ``certificate_refused`` turns it into ``Refused`` with what
  to do; the coordinator client raises it at once instead of retrying.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from node.errors import Refused
from protocol.errors import ConfigError

LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
#: What to do about a certificate that does not verify (the node's refusal, doctor's fix).
CERTIFICATE_FIX = (
    "if the run uses its own CA or a self-signed certificate, pass that CA file with --ca-cert"
    " PATH (or SPARSELOCO_NODE_CA_CERT) as the operator gave it; otherwise someone may be"
    " intercepting the connection: check the URL with the operator before going on"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host, no brackets) certainly means this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it could resolve anywhere


def resolves(host: str) -> bool:
    """Whether ``host`` is an address, or a name this machine resolves."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def check_coordinator_url(url: str, *, allow_insecure_http: bool) -> str:
    """``url`` without a trailing slash; ``ValueError`` saying what to do if it is not https and
    not loopback (unless allowed), or not an http(s) URL at all."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--coordinator {url!r} is not an http(s) URL; e.g. https://HOST:8700")
    if parts.scheme == "http" and not allow_insecure_http and not is_loopback(parts.hostname):
        if not resolves(parts.hostname):  # a typo first: the security advice would mislead
            raise ValueError(
                f"--coordinator {url}: the name {parts.hostname!r} does not resolve (a typo?);"
                " check the address the operator gave (e.g. http://localhost:8700 on this"
                " machine)"
            )
        raise ValueError(
            f"--coordinator {url} is plain HTTP to another machine: the token and the run's"
            " manifest key would cross the network unprotected. Use the coordinator's https://"
            " URL (its [server] tls_cert, or a TLS proxy: deploy/README.md), or, on a network"
            " you trust (a private container network, a VPN), pass --allow-insecure-http"
            " (SPARSELOCO_NODE_ALLOW_INSECURE_HTTP=1)"
        )
    return url.rstrip("/")


def client_context(ca_cert: Path | None) -> ssl.SSLContext:
    """The client side of TLS: the system's CAs, and ``ca_cert`` (PEM) too when given."""
    context = ssl.create_default_context()
    if ca_cert is not None:
        try:
            context.load_verify_locations(cafile=ca_cert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"--ca-cert (or SPARSELOCO_NODE_CA_CERT): cannot load {ca_cert} as PEM"
                f" certificates ({getattr(exc, 'strerror', None) or exc}); give the CA"
                " certificate that signed the coordinator's, or its self-signed certificate"
            ) from exc
    return context


def connector(ca_cert: Path | None) -> aiohttp.TCPConnector:
    """An aiohttp connector verifying TLS with ``client_context(ca_cert)``."""
    return aiohttp.TCPConnector(ssl=client_context(ca_cert))


def certificate_reason(exc: aiohttp.ClientConnectorCertificateError) -> str:
    """Why the certificate did not verify, in OpenSSL's words ("self-signed certificate")."""
    cause = exc.certificate_error
    return str(getattr(cause, "verify_message", None) or cause)


def certificate_refused(url: str, exc: aiohttp.ClientConnectorCertificateError) -> Refused:
    """A certificate that did not verify, as a refusal that says what to do."""
    return Refused(
        f"the coordinator at {url} presented a TLS certificate this machine does not trust"
        f" ({certificate_reason(exc)}): {CERTIFICATE_FIX}"
    )
