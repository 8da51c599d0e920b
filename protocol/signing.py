"""Manifest signatures: the canonical bytes a coordinator signs and the check every node makes.

A closed round's ``Manifest`` is signed with the coordinator's Ed25519 key over its canonical
JSON (sorted keys, no spaces, no NaN: ``manifest_bytes``). Nodes receive the public key (32 raw
bytes, hex) when they join and verify every manifest before they act on it; the chaos suite and
the tests use the same ``verify_manifest``. This is the only place either side computes the
signed bytes, so signer and verifier cannot drift apart.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import ManifestError
from protocol.messages import Manifest, SignedManifest
from protocol.runconfig import canonical_json

#: Fields of a gather entry left out of the canonical bytes when None, so a manifest signed
#: before they existed verifies as it was signed.
OPTIONAL_ENTRY_FIELDS = ("steps", "tokens")


def manifest_bytes(manifest: Manifest) -> bytes:
    """The canonical bytes of a manifest: what the coordinator signs and nodes verify."""
    document = manifest.model_dump(mode="json")
    for entry in document["gather"]:
        for key in OPTIONAL_ENTRY_FIELDS:
            if entry.get(key) is None:
                entry.pop(key, None)
    return canonical_json(document)


def public_key_hex(key: Ed25519PrivateKey) -> str:
    """The raw public key of ``key`` as hex, the form a join response carries."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def sign_manifest(key: Ed25519PrivateKey, manifest: Manifest) -> SignedManifest:
    """``manifest`` with the hex Ed25519 signature of its canonical bytes."""
    return SignedManifest(manifest=manifest, signature=key.sign(manifest_bytes(manifest)).hex())


def verify_manifest(
    signed: SignedManifest,
    public_key: str,
    *,
    run_id: str | None = None,
    round_: int | None = None,
) -> Manifest:
    """The manifest once its signature by ``public_key`` (hex) checks out.

    With ``run_id`` and ``round_`` it must also be for that run and round. Raises
    ``ManifestError`` otherwise (also for a malformed key or signature).
    """
    manifest = signed.manifest
    where = f"round {manifest.round if round_ is None else round_}"
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        key.verify(bytes.fromhex(signed.signature), manifest_bytes(manifest))
    except (InvalidSignature, ValueError) as exc:
        raise ManifestError(f"{where}: manifest signature does not verify") from exc
    if (run_id is not None and manifest.run_id != run_id) or (
        round_ is not None and manifest.round != round_
    ):
        raise ManifestError(
            f"manifest is for run {manifest.run_id} round {manifest.round},"
            f" expected {run_id} round {round_}"
        )
    return manifest
