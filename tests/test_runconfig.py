"""The run config's identity: what its run id hashes."""

from __future__ import annotations

from protocol.runconfig import RunConfig


def test_run_ids_from_before_the_variants_stay_the_same() -> None:
    # The canonical form of a config without "eager" is the one it had when overlap was a
    # boolean: a coordinator database of such a run keeps its run id across the upgrade.
    before = {
        "off": '"overlap":false',
        "delayed": '"overlap":true',
        "eager": '"overlap":"eager"',
    }
    for variant, text in before.items():
        assert text in RunConfig(overlap=variant).canonical().decode()
    assert RunConfig(overlap=True).run_id == RunConfig(overlap="delayed").run_id
    assert RunConfig().run_id != RunConfig(overlap="eager").run_id


def test_the_protocol_version_is_part_of_the_run_id(monkeypatch) -> None:
    import protocol.runconfig as runconfig

    assert f'"protocol":{runconfig.PROTOCOL}' in RunConfig().canonical().decode()
    before = RunConfig().run_id
    monkeypatch.setattr(runconfig, "PROTOCOL", runconfig.PROTOCOL - 1)
    assert RunConfig().run_id != before
