"""The coordinator's config: precedence (flags > env > TOML > defaults) and readable errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.server import ANNOUNCE_FILE
from protocol.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "run.example.toml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.server.port == 8700 and config.tokens["alice"]
    assert config.run_id.startswith("demo-")
    assert ANNOUNCE_FILE == "coordinator.json"


def test_precedence_flags_env_file_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSELOCO_COORD_SERVER__PORT", "9001")
    monkeypatch.setenv("SPARSELOCO_COORD_SERVER__HOST", "0.0.0.0")
    monkeypatch.setenv("SPARSELOCO_COORD_RUN__GATHER_SIZE", "3")
    config = load_config(EXAMPLE, {"server": {"port": 0, "host": None}})
    assert config.server.port == 0  # flag beats env
    assert config.server.host == "0.0.0.0"  # env beats file (absent flag ignored)
    assert config.run.gather_size == 3 and config.run.rounds == 20  # env merges into the file
    assert config.server.presign_expiry_s == 900  # default


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"run": {"gather_size": 0}}, "run.gather_size"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"tokens": {"bad id!": "x" * 20}}, "tokens"),
        ({"tokens": {"n0": "short"}}, "secrets.token_hex"),
        ({"storage": {"endpoint_url": "ftp://x"}}, "storage.endpoint_url"),
        ({"server": {"nonsense": 1}}, "server.nonsense"),
    ],
)
def test_errors_name_field_and_fix(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match="config field") as info:
        load_config(EXAMPLE, overrides)
    assert needle in str(info.value)
    assert "SPARSELOCO_COORD_" in str(info.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
