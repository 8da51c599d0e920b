"""The coordinator's manifest signing key (Ed25519), kept in the state directory.

Nodes verify every manifest with the public key handed out at join, so the key must survive a
restart: it is created once at ``{state_dir}/manifest-key.pem`` (PKCS#8, mode 0600, written
without a window where another user could read it) and loaded on every later start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import ConfigError
from protocol.messages import Manifest, SignedManifest, manifest_bytes

log = logging.getLogger("sparseloco.coordinator.signing")

KEY_FILE = "manifest-key.pem"


class ManifestSigner:
    """Signs manifests with one Ed25519 private key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key_hex = raw.hex()

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
        signature = self._key.sign(manifest_bytes(manifest)).hex()
        return SignedManifest(manifest=manifest, signature=signature)


def verify(signed: SignedManifest, public_key_hex: str) -> bool:
    """Whether ``signed`` carries a valid signature by the key ``public_key_hex``."""
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
    try:
        key.verify(bytes.fromhex(signed.signature), manifest_bytes(signed.manifest))
    except InvalidSignature:
        return False
    return True
