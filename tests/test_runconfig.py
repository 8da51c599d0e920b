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


def test_merge_names_its_step_and_checks_the_base_after_the_aggregate_in_flight() -> None:
    import pytest
    from pydantic import ValidationError

    from protocol.runconfig import DEFAULT_MERGE_STEP

    merge = RunConfig(overlap="merge", inner_steps=30, overlap_tau=5)
    assert merge.merge_step == 5 and merge.overlaps and not merge.late_base
    assert RunConfig(overlap="merge").merge_step == DEFAULT_MERGE_STEP
    assert RunConfig(overlap="merge", inner_steps=1).merge_step == 1
    assert RunConfig(overlap="eager").merge_step is None
    # Payloads of round r are based on θ_r, as without overlap; delayed and eager on θ_{r-1}.
    assert [merge.base_round(r) for r in range(3)] == [None, 0, 1]
    assert [RunConfig(overlap="eager").base_round(r) for r in range(3)] == [None, None, 0]
    # τ is part of the run id; a run without it keeps the id it had before "merge" existed.
    assert "overlap_tau" not in RunConfig().canonical().decode()
    assert merge.run_id != RunConfig(overlap="merge", inner_steps=30, overlap_tau=6).run_id
    with pytest.raises(ValidationError, match="exceeds inner_steps"):
        RunConfig(overlap="merge", inner_steps=10, overlap_tau=11)
    with pytest.raises(ValidationError, match="applies to overlap"):
        RunConfig(overlap="eager", overlap_tau=3)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RunConfig(overlap="merge", overlap_tau=0)


def test_a_merge_inside_a_step_names_its_rows() -> None:
    import pytest
    from pydantic import ValidationError

    rows = RunConfig(overlap="merge", inner_steps=30, batch_size=8, overlap_tau=2, overlap_rows=3)
    assert (rows.merge_step, rows.merge_rows) == (2, 3)
    assert RunConfig(overlap="merge", overlap_tau=2).merge_rows is None  # after the whole step
    # Neither set: a quarter into the first step, at least one row, never the whole batch.
    assert RunConfig(overlap="merge", batch_size=12).merge_rows == 3
    assert [RunConfig(overlap="merge", batch_size=b).merge_rows for b in (1, 2, 4)] == [None, 1, 1]
    assert RunConfig(overlap="merge", batch_size=12, overlap_rows=5).merge_rows == 5
    assert RunConfig(overlap="eager").merge_rows is None
    # The rows are part of the run id; a run without them keeps the id it had before.
    assert "overlap_rows" not in RunConfig(overlap="merge", overlap_tau=2).canonical().decode()
    assert '"overlap_rows":3' in rows.canonical().decode()
    with pytest.raises(ValidationError, match="must be below batch_size=8"):
        RunConfig(overlap="merge", batch_size=8, overlap_rows=8)
    with pytest.raises(ValidationError, match="applies to overlap"):
        RunConfig(overlap="delayed", overlap_rows=1)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RunConfig(overlap="merge", overlap_rows=0)
