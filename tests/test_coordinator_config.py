"""The coordinator's config: precedence (flags > env > TOML > defaults) and readable errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.base.config import load_config
from coordinator.base.config_file import state_dir_of
from coordinator.ops.server import ANNOUNCE_FILE
from protocol.errors import ConfigError
from protocol.runconfig import RunConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "run.example.toml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    # No tokens in the example: participants are added with `sparseloco coordinator token add`.
    assert config.server.port == 8700 and config.tokens == {}
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
    ],
)
def test_errors_name_field_and_fix(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match="config field") as info:
        load_config(EXAMPLE, overrides)
    assert needle in str(info.value)
    assert "SPARSELOCO_COORD_" in str(info.value)


def test_a_rule_across_a_tables_fields_does_not_list_every_key() -> None:
    """A cross-field error's "got" is the whole table: its size, not a list of its keys."""
    with pytest.raises(ConfigError, match="overlap_tau=3 applies to") as info:
        load_config(EXAMPLE, {"run": {"overlap_tau": 3}})
    text = str(info.value)
    assert "(got a table of " in text and "inner_steps, " not in text and "\n" not in text
    assert len(text) < 300


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_unknown_keys_name_the_closest_known_one(tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text(
        EXAMPLE.read_text()
        .replace("port = 8700", "prot = 8700")
        .replace("[storage]", "[stroage]")
        .replace("factor = 2.0", "facotr = 2.0")
    )
    with pytest.raises(ConfigError) as info:
        load_config(typo)
    text = str(info.value)
    assert "server.prot: unknown key; did you mean server.port?" in text
    assert "stroage: unknown section; did you mean [storage]?" in text
    assert "run.timing.facotr: unknown key; did you mean run.timing.factor?" in text
    assert "set [server] prot" not in text  # never the advice to set the misspelt key
    with pytest.raises(ConfigError, match=r"server\.nonsense: unknown key; remove it"):
        load_config(EXAMPLE, {"server": {"nonsense": 1}})


def test_toml_values_are_not_coerced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quoted = tmp_path / "quoted.toml"
    text = EXAMPLE.read_text().replace("topk = 64 ", 'topk = "64" ')
    quoted.write_text(text.replace("clip = true", "clip = 1"))
    with pytest.raises(ConfigError) as info:
        load_config(quoted)
    assert "run.topk: Input should be a valid integer (got '64')" in str(info.value)
    assert "run.clip: Input should be a valid boolean (got 1)" in str(info.value)
    # The environment is text by nature: it is still converted.
    monkeypatch.setenv("SPARSELOCO_COORD_RUN__TOPK", "32")
    assert load_config(EXAMPLE).run.topk == 32
    # And a RunConfig in a wire message still parses from JSON as before.
    assert RunConfig.model_validate_json('{"topk": 16, "alpha": 1}').alpha == 1.0


def test_errors_never_show_a_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret, token_text = "s3cr3t-store-key-value", "tok-of-bob-0123456789abcdef"
    broken = tmp_path / "broken.toml"
    broken.write_text(
        '[server]\nstate_dir = "x"\n'
        f'[stroage]\nendpoint_url = "http://h"\nsecret_key = "{secret}"\n'
        f'[storage]\nendpoint_url = "http://h"\nbucket = "abc"\naccess_key = "AKIA123456"\n'
        f'secret_kye = "{secret}"\nsecret_key = 5\n'
        f'[tokens]\nalice = "short"\nbob = "{token_text}"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    text = str(info.value)
    assert "secret_key" in text and "stroage" in text and "alice" in text
    for value in (secret, token_text, "AKIA123456"):
        assert value not in text, value
    monkeypatch.setenv("SPARSELOCO_COORD_TOKENS", '{"carol": "env-token-0123456789", "d": "x"}')
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE)
    assert "env-token-0123456789" not in str(info.value)


def test_tokens_may_all_live_in_the_database(tmp_path: Path) -> None:
    no_tokens = tmp_path / "no-tokens.toml"
    no_tokens.write_text(EXAMPLE.read_text().split("[tokens]")[0])
    config = load_config(no_tokens)
    assert config.tokens == {}  # fine: `sparseloco coordinator token add` issues them
    assert state_dir_of(EXAMPLE) == Path("./coordinator-state")
    assert state_dir_of(EXAMPLE, "/elsewhere") == Path("/elsewhere")
    with pytest.raises(ConfigError, match="--state-dir"):
        state_dir_of(None)
