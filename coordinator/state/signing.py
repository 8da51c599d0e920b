"""The coordinator's manifest signing key (Ed25519), kept in the state directory.

What is signed, and how a signature is checked, is ``protocol.signing``; this module only keeps
the private key.

Nodes verify every manifest with the public key handed out at join, so the key must survive a
restart: it is created once at ``{state_dir}/manifest-key.pem`` (PKCS#8, mode 0600, written
without a window where another user could read it) and loaded on every later start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.errors import ConfigError
from protocol.messages import Manifest, SignedManifest
from protocol.signing import public_key_hex, sign_manifest

log = logging.getLogger("sparseloco.coordinator.signing")

KEY_FILE = "manifest-key.pem"


class ManifestSigner:
    """Signs manifests with one Ed25519 private key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key_hex = public_key_hex(key)

    @classmethod
    def load_or_create(cls, state_dir: Path) -> ManifestSigner:
        """The key in ``state_dir``, created there (mode 0600) if it does not exist yet."""
        path = state_dir / KEY_FILE
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except ValueError as exc:
                raise ConfigError(
                    f"{path} is not a PEM private key; restore it from a backup (nodes verify"
                    " manifests with it) or start a new run with a new --state-dir"
                ) from exc
            if not isinstance(key, Ed25519PrivateKey):
                raise ConfigError(f"{path} is not an Ed25519 key; restore the original file")
            return cls(key)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        log.info("event=signing_key_created path=%s", path)
        return cls(key)

    def sign(self, manifest: Manifest) -> SignedManifest:
        return sign_manifest(self._key, manifest)
