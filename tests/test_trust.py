"""The node's trust anchor and its limits: invites, the pinned manifest key, the resync bound.

The daemon runs against the in-memory fakes (``support.daemon_harness``); the fake coordinator's
``join_key`` plays a man in the middle who swaps the manifest key in the join response. The
real-process side (TLS, the console script) is ``tests/test_tls.py`` and ``tests/test_cli.py``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.compute.stateread import load_state
from node.daemon.pinning import PIN_FILE, trusted_key
from node.daemon.settings import load_connection, load_settings
from node.errors import Refused, ResyncError, StateError
from protocol.errors import ConfigError, ManifestError
from protocol.invite import Invite, decode_invite, key_fingerprint, normalize_fingerprint
from protocol.messages import SignedManifest
from protocol.signing import public_key_hex
from support.daemon_harness import run_config, until, worker
from support.diverge import diverge

TOKEN = "invite-test-token-0123456789abcdef"


def other_key() -> str:
    return public_key_hex(Ed25519PrivateKey.generate())


def invite(url: str = "https://coord.example:8700", key: str | None = None) -> str:
    fp = key_fingerprint(key or other_key())
    return Invite(coordinator=url, token=TOKEN, manifest_key=fp).encode()


# -- the invite string -------------------------------------------------------------------------


def test_an_invite_round_trips_and_survives_pasting() -> None:
    key = other_key()
    text = invite("https://coord.example:8700/", key)
    assert text.startswith("sparseloco-invite:v1:") and TOKEN not in text
    pasted = "  " + text[:30] + "\n  " + text[30:] + "\n"  # wrapped by a mail client
    got = decode_invite(pasted)
    assert (got.coordinator, got.token) == ("https://coord.example:8700", TOKEN)
    assert got.manifest_key == key_fingerprint(key) == "sha256:" + got.manifest_key[7:]
    assert TOKEN not in repr(got) and TOKEN not in str(got)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hello", "not a sparseloco invite"),
        ("sparseloco-invite:v9:abc", "newer format"),
        ("sparseloco-invite:v1:!!!", "damaged"),
        ("sparseloco-invite:v1:eyJ0b2tlbiI6InNlY3JldC10b2tlbiJ9", "damaged"),  # no url, no key
    ],
)
def test_a_bad_invite_says_what_to_do_and_never_shows_the_token(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        decode_invite(text)
    assert "secret-token" not in str(caught.value)


def test_a_cut_invite_is_refused() -> None:
    with pytest.raises(ConfigError, match="damaged"):
        decode_invite(invite()[:-6])


def test_fingerprints_are_read_as_people_write_them() -> None:
    fp = key_fingerprint(other_key())
    digits = fp.removeprefix("sha256:")
    spaced = ":".join(digits[i : i + 2] for i in range(0, 64, 2)).upper()
    assert normalize_fingerprint(digits) == normalize_fingerprint(spaced) == fp
    with pytest.raises(ValueError, match="not a manifest key fingerprint"):
        normalize_fingerprint(digits[:-1])


# -- settings: invites, precedence, plain HTTP --------------------------------------------------


def test_an_invite_fills_the_settings_and_explicit_values_win(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("COORDINATOR", "TOKEN", "INVITE", "MANIFEST_KEY_FINGERPRINT"):
        monkeypatch.delenv(f"SPARSELOCO_NODE_{name}", raising=False)
    key = other_key()
    text = invite("https://a.example", key)
    s = load_settings(invite=text, state_dir=tmp_path)
    assert (s.coordinator, s.token) == ("https://a.example", TOKEN)
    assert s.manifest_key_fingerprint == key_fingerprint(key)
    # a flag wins over the flag's invite; an environment variable over the environment's invite
    assert load_settings(invite=text, token="flag-token", state_dir=tmp_path).token == "flag-token"
    monkeypatch.setenv("SPARSELOCO_NODE_INVITE", text)
    monkeypatch.setenv("SPARSELOCO_NODE_TOKEN", "env-token")
    from_env = load_settings(state_dir=tmp_path)
    assert (from_env.coordinator, from_env.token) == ("https://a.example", "env-token")
    # ... but an invite given as a flag wins over the environment's variables
    assert load_settings(invite=text, state_dir=tmp_path).token == TOKEN


def test_plain_http_is_refused_to_another_machine_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SPARSELOCO_NODE_ALLOW_INSECURE_HTTP", raising=False)
    for url in ("http://127.0.0.1:8700", "http://localhost:8700/", "http://[::1]:8700"):
        assert load_connection(coordinator=url).coordinator == url.rstrip("/")
    with pytest.raises(ConfigError, match="plain HTTP to another machine"):
        load_connection(coordinator="http://192.0.2.10:8700", token="t")
    # A name that does not resolve is a typo first, not a security question.
    with pytest.raises(ConfigError, match="'localhots' does not resolve"):
        load_connection(coordinator="http://localhots:8700", token="t")
    with pytest.raises(ConfigError, match="plain HTTP to another machine"):
        load_settings(invite=invite("http://10.0.0.5:8700"), state_dir=tmp_path)
    allowed = load_connection(coordinator="http://coord.example:8700", allow_insecure_http=True)
    assert allowed.coordinator == "http://coord.example:8700"
    monkeypatch.setenv("SPARSELOCO_NODE_ALLOW_INSECURE_HTTP", "1")
    assert load_connection(coordinator="http://coord.example:8700").allow_insecure_http
    with pytest.raises(ConfigError, match=r"--ca-cert .*is not a file"):
        load_connection(coordinator="https://c.example", ca_cert=tmp_path / "missing.pem")


# -- pinning, the function ---------------------------------------------------------------------


def test_the_trusted_key_checks_the_fingerprint_then_the_pin(tmp_path: Path) -> None:
    real, forged = other_key(), other_key()
    with pytest.raises(Refused, match="not the one in your invite"):
        trusted_key(tmp_path, forged, key_fingerprint(real))
    assert not (tmp_path / PIN_FILE).exists()  # nothing trusted from a refused join
    assert trusted_key(tmp_path, real.upper(), key_fingerprint(real)) == real
    assert (tmp_path / PIN_FILE).read_text().strip() == real
    assert trusted_key(tmp_path, real, None) == real  # the same key later: fine
    with pytest.raises(Refused, match="differs from the one this node trusted"):
        trusted_key(tmp_path, forged, None)
    with pytest.raises(Refused, match="differs from the one this node trusted"):
        trusted_key(tmp_path, forged, key_fingerprint(forged))  # a new invite is not enough
    with pytest.raises(Refused, match="no valid manifest key"):
        trusted_key(tmp_path, "zz", None)
    (tmp_path / PIN_FILE).write_text("garbage\n")
    with pytest.raises(StateError, match="damaged"):
        trusted_key(tmp_path, real, None)


# -- pinning, in the daemon --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_swapped_key_in_the_join_is_refused_before_anything_is_trained(harness) -> None:
    h = harness(run_config())
    real = h.coord.public_key
    h.coord.join_key = other_key()  # the man in the middle
    daemon = h.daemon("node-0", manifest_key_fingerprint=key_fingerprint(real))
    with pytest.raises(Refused, match="not the one in your invite: someone may be intercepting"):
        await daemon.run(handle_signals=False)
    endpoints = [call[1] for call in h.coord.calls]
    assert endpoints == ["join", "leave"]  # joined, refused the key, left: nothing trained
    assert not (h.state_dir("node-0") / PIN_FILE).exists()


@pytest.mark.asyncio
async def test_the_first_join_pins_the_key_and_later_starts_refuse_another(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(rounds=1))
    assert await h.daemon("node-0").run(handle_signals=False) == 0  # no fingerprint: TOFU
    pinned = (h.state_dir("node-0") / PIN_FILE).read_text().strip()
    assert pinned == h.coord.public_key
    assert any("manifest_key_pinned node=node-0 source=first_use" in m for m in caplog.messages)
    h.coord.join_key = other_key()
    with pytest.raises(Refused, match="differs from the one this node trusted"):
        await h.daemon("node-0").run(handle_signals=False)
    assert (h.state_dir("node-0") / PIN_FILE).read_text().strip() == pinned


@pytest.mark.asyncio
async def test_with_the_invites_fingerprint_the_node_runs_and_verifies_with_the_pin(
    harness, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(rounds=2))
    fp = key_fingerprint(h.coord.public_key)
    daemon = h.daemon("node-0", manifest_key_fingerprint=fp.upper())
    assert await daemon.run(handle_signals=False) == 0
    assert daemon.joined is not None and daemon.joined.manifest_public_key == h.coord.public_key
    assert any(f"source=invite fingerprint={fp}" in m for m in caplog.messages)
    assert set(h.reports(1)) == {"node-0"}


@pytest.mark.asyncio
async def test_a_forged_gather_set_is_never_applied(harness) -> None:
    """A man in the middle who cannot sign drops a peer from round 0's gather set: the node
    stops on the signature before it downloads or applies anything."""
    h = harness(run_config(min_nodes=2, rounds=2))

    def drop_a_peer(signed: SignedManifest) -> SignedManifest:
        manifest = signed.manifest
        forged = manifest.model_copy(update={"gather": manifest.gather[:1]})
        return SignedManifest(manifest=forged, signature=signed.signature)

    h.coord.forge = drop_a_peer
    victim = h.start(h.daemon("node-0"))
    other = h.start(h.daemon("node-1"))
    with pytest.raises(ManifestError, match="round 0: manifest signature does not verify"):
        await victim
    with pytest.raises(ManifestError):
        await other
    assert h.reports(0) == {}  # nobody applied round 0
    for node in ("node-0", "node-1"):
        state = load_state(h.state_dir(node), worker(run_config()).shapes)
        assert state is None or state.round == 0


# -- the resync bound --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_node_that_keeps_diverging_stops_after_a_few_resyncs(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(min_nodes=3, rounds=4))
    daemons = {
        # node-2's θ is corrupted every time it applies round 0: resyncing can never help it.
        n: diverge(h.daemon(n), lambda r: r == 0) if n == "node-2" else h.daemon(n)
        for n in ("node-0", "node-1", "node-2")
    }
    tasks = {n: h.start(d) for n, d in daemons.items()}
    async with asyncio.timeout(60):  # without the bound this loops until the timeout
        with pytest.raises(ResyncError, match="again right after resynchronising"):
            await tasks["node-2"]
    resyncs = [m for m in caplog.messages if "event=resynced node=node-2" in m]
    assert len(resyncs) == 3
    for name in ("node-0", "node-1"):
        daemons[name].request_stop()
    await until(lambda: all(tasks[n].done() for n in ("node-0", "node-1")), "the others to stop")
    assert all(tasks[n].result() == 0 for n in ("node-0", "node-1"))


@pytest.mark.asyncio
async def test_a_node_whose_checkpoint_is_rejected_each_time_stops_and_says_so(
    harness, caplog
) -> None:
    caplog.set_level(logging.INFO)
    h = harness(run_config(min_nodes=3, rounds=4, checkpoint_every=1))
    names = ("node-0", "node-1", "node-2")
    # node-2's θ is corrupted every time it applies round 0: resyncing can never help it.
    daemons = {
        n: diverge(h.daemon(n), lambda r: r == 0) if n == "node-2" else h.daemon(n) for n in names
    }
    # node-2 cannot fetch any checkpoint: each resync falls back to θ_0 and diverges again
    h.store.plans["node-2"].missing |= {h.coord.book.key(r) for r in range(1, 4)}
    tasks = {n: h.start(d) for n, d in daemons.items()}
    async with asyncio.timeout(60):
        with pytest.raises(
            ResyncError, match=r"the newest checkpoint was rejected: round \d+: .*404"
        ):
            await tasks["node-2"]
    # each of the 3 resyncs tried every checkpoint it could not fetch before falling back to θ_0
    assert sum("event=resynced node=node-2" in m for m in caplog.messages) <= 3
    assert sum("event=checkpoint_rejected node=node-2" in m for m in caplog.messages) >= 3
    for name in ("node-0", "node-1"):
        daemons[name].request_stop()
    await until(lambda: all(tasks[n].done() for n in names[:2]), "the others to stop")
