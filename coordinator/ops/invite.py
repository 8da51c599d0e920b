"""Invites from the operator's side: the coordinator's public URL and its manifest key's
fingerprint, next to a new token (``protocol.invite`` is the format).

``token add NODE --invite`` needs two things besides the token:

- the URL participants reach the coordinator at: ``--url`` when the operator gives one (the
  public address behind a proxy or NAT), else ``[server]`` of the config (``https`` when
  ``tls_cert`` is set; host and port), else the URL a running coordinator announced in
  ``coordinator.json``. An address that means "every interface" (``0.0.0.0``) names no
  machine, so it asks for ``--url`` instead;
- the fingerprint of the manifest signing key in the state directory, which exists once the
  coordinator has started (as the database the token goes into does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coordinator.base.config_file import server_values
from coordinator.base.errors import TokenAdminError
from coordinator.state.signing import KEY_FILE, ManifestSigner
from protocol.invite import key_fingerprint

#: Bind addresses that listen everywhere and so name no machine a participant could reach.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def manifest_key_fingerprint(state_dir: Path) -> str:
    """``sha256:<hex>`` of the public half of the coordinator's manifest signing key."""
    if not (state_dir / KEY_FILE).is_file():
        raise TokenAdminError(
            f"no manifest signing key at {state_dir / KEY_FILE}: start the coordinator once with"
            " this state directory"
        )
    return key_fingerprint(ManifestSigner.load_or_create(state_dir).public_key_hex)


def public_url(url: str | None, config: str | None, state_dir: Path) -> str:
    """The coordinator URL to put in an invite (see the module docstring for the order)."""
    if url is not None:
        return _checked(url, "--url")
    if config is not None:
        derived = _from_server(server_values(config))
        if derived is not None:
            return _checked(derived, f"[server] of {config}")
    from coordinator.ops.server import ANNOUNCE_FILE  # here: the server pulls in the whole service

    announce = state_dir / ANNOUNCE_FILE
    if announce.is_file():
        try:
            announced = json.loads(announce.read_text()).get("url")
        except (OSError, ValueError, AttributeError):
            announced = None
        if isinstance(announced, str):
            return _checked(announced, f"the running coordinator ({announce})")
    raise TokenAdminError(
        "cannot tell the coordinator's URL for the invite: pass --url https://HOST:PORT (the"
        " address participants reach), or --config with [server] host and port"
    )


def _from_server(server: dict[str, Any]) -> str | None:
    """``scheme://host:port`` from a ``[server]`` table; None when its port is 0 (chosen at
    start, so only a running coordinator knows it)."""
    try:
        port = int(server.get("port", 8700))
    except (TypeError, ValueError):
        return None
    if port == 0:
        return None
    host = str(server.get("host", "127.0.0.1"))
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if server.get("tls_cert") else "http"
    return f"{scheme}://{host}:{port}"


def _checked(url: str, source: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TokenAdminError(f"{source}: {url!r} is not an http(s) URL")
    if (parts.hostname or "") in WILDCARD_HOSTS:
        raise TokenAdminError(
            f"{source} gives {url}, which listens on every interface but names no machine;"
            " pass --url with the address participants reach, e.g. --url"
            " https://coordinator.example.org"
        )
    return url.rstrip("/")
