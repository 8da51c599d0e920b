"""The ``sparseloco`` console script as an operator runs it: every documented command works.

Every command of README's "Commands" block runs through the real console script (the
``sparseloco`` installed next to this interpreter) with ``--help``: it must exist and offer every
flag the README shows for it. Besides: ``--version``; ``sparseloco node`` checks its settings
before torch is imported; ``sparseloco coordinator --config run.toml`` starts a real coordinator
that reaches "listening" and stops on SIGTERM; and the token commands change who may take part
while that coordinator runs.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from node.cluster.seaweed import EmbeddedStore
from protocol.runconfig import RunConfig
from support.harness import REPO_ROOT, write_coordinator_config

SPARSELOCO = Path(sys.executable).parent / "sparseloco"
README = REPO_ROOT / "README.md"
CONFIG_TOKEN = "cli-test-token-of-n0-0123456789"


def sparseloco(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SPARSELOCO), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )


def readme_commands() -> list[tuple[list[str], list[str]]]:
    """(subcommand words, flags) of each ``sparseloco`` line in README's Commands block."""
    section = README.read_text().split("## Commands", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = []
    for line in block.splitlines():
        words = line.split("#", 1)[0].split()
        if "sparseloco" not in words:
            continue
        rest = words[words.index("sparseloco") + 1 :]
        sub = []
        for word in rest:
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            sub.append(word)
        commands.append((sub, re.findall(r"--[a-z][a-z-]*", " ".join(rest))))
    return commands


COMMANDS = readme_commands()


def test_the_readme_documents_every_command() -> None:
    documented = {" ".join(sub) for sub, _ in COMMANDS}
    assert {"up", "coordinator", "node", "simulate", "bench codec", "bench quality"} <= documented


@pytest.mark.parametrize(("sub", "flags"), COMMANDS, ids=[" ".join(s) for s, _ in COMMANDS])
def test_each_documented_command_has_help_with_its_flags(sub: list[str], flags: list[str]) -> None:
    proc = sparseloco(*sub, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: sparseloco {' '.join(sub)}"), proc.stdout[:200]
    missing = [flag for flag in flags if flag not in proc.stdout]
    assert not missing, f"README shows {missing} for `sparseloco {' '.join(sub)}`"


def _subcommands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> set[str]:
    """Every command path the parser accepts (``bench sweep``, ``data prepare``, ...)."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _subcommands(sub, (*words, name)) or {" ".join((*words, name))}
    return found


def test_every_command_of_the_help_is_in_the_readme() -> None:
    """The other direction: whatever ``--help`` offers (``sparseloco`` and ``coordinator
    token``) has a line in README's Commands block."""
    from coordinator.ops.admin import build_parser as token_parser
    from node.cli import build_parser

    offered = _subcommands(build_parser()) | {
        f"coordinator token {name}" for name in _subcommands(token_parser("token"))
    }
    top = sparseloco("--help").stdout
    assert all(name.split()[0] in top for name in offered)
    documented = {" ".join(sub) for sub, _ in COMMANDS}
    assert not offered - documented, f"README's Commands block lacks {offered - documented}"


def _alternatives(flag: str) -> dict[str, set[str]]:
    """The ``FLAG a|b|c`` lists of README's Commands block, by command."""
    section = README.read_text().split("## Commands", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lists = {}
    for line in block.splitlines():
        words = line.split("#", 1)[0].split()
        m = re.search(rf"{flag} ([a-z0-9_]+(?:\|[a-z0-9_]+)+)", line)
        if "sparseloco" in words and m:
            lists[words[words.index("sparseloco") + 1]] = set(m.group(1).split("|"))
    return lists


def test_readme_and_the_example_config_list_the_presets_the_code_has() -> None:
    """Lists of presets and models, wherever they are shown, are the code's tables: the help
    texts are generated from them, README and deploy/run.example.toml are checked here."""
    from node.compute.modelconfig import PRESETS as MODELS
    from node.compute.presets import PRESETS as RUNS

    assert _alternatives("--preset") == {"up": set(RUNS), "simulate": set(RUNS)}
    assert _alternatives("--model") == {"simulate": set(MODELS)}
    for command, table in (("up", RUNS), ("simulate", RUNS)):
        help_text = " ".join(sparseloco(command, "--help").stdout.split())
        assert ", ".join(table) in help_text
    assert ", ".join(MODELS) in " ".join(sparseloco("simulate", "--help").stdout.split())
    example = (REPO_ROOT / "deploy" / "run.example.toml").read_text()
    listed = re.search(r"model = .*?\n((?:#.*\n)+)", example)
    assert listed is not None
    names = set(re.findall(r"[a-z0-9_]+", listed.group(1).split("(llama_*")[0]))
    assert names == set(MODELS), names ^ set(MODELS)


def test_coordinator_help_answers_without_loading_the_service() -> None:
    """``coordinator --help`` imports neither aiohttp, boto3 nor torch (it took seconds)."""
    code = (
        "import sys, contextlib, io\n"
        "from coordinator.__main__ import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in ('aiohttp', 'boto3', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert proc.stdout.split() == ["[]"], proc.stderr


@pytest.mark.parametrize("action", ["add", "list", "revoke"])
def test_token_commands_have_help(action: str) -> None:
    proc = sparseloco("coordinator", "token", action, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: sparseloco coordinator token {action}" in proc.stdout
    assert "--state-dir" in proc.stdout and "--config" in proc.stdout


def test_version() -> None:
    top = sparseloco("--version")
    assert top.returncode == 0 and re.fullmatch(r"sparseloco \d+\.\d+\.\d+\S*\n", top.stdout)
    for proc in (
        sparseloco("coordinator", "--version"),
        subprocess.run(
            [sys.executable, "-m", "coordinator", "--version"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
        ),
    ):
        assert (proc.returncode, proc.stdout) == (0, top.stdout)


def test_unknown_arguments_are_still_refused() -> None:
    proc = sparseloco("up", "--nodse", "3")
    assert proc.returncode == 2 and "unrecognized arguments: --nodse 3" in proc.stderr


def test_node_settings_are_checked_before_torch_loads(tmp_path: Path) -> None:
    code = (
        "import sys; from node.cli import main;"
        " rc = main(['node', '--state-dir', 'x']); print(rc, 'torch' in sys.modules)"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "--coordinator (or SPARSELOCO_NODE_COORDINATOR): Field required" in proc.stderr
    assert time.monotonic() - started < 15


def test_a_bad_coordinator_config_is_refused_through_the_console_script(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nstate_dir = "x"\nprot = 1\n')
    proc = sparseloco("coordinator", "--config", str(bad))
    assert proc.returncode == 2
    assert "did you mean server.port?" in proc.stderr and "storage" in proc.stderr


def test_a_misspelled_model_preset_is_refused_where_it_is_written(tmp_path: Path) -> None:
    """Before, the coordinator took ``model = "llama_tin"``, listened, and every node that
    joined crashed with a traceback; now the config check refuses it: one line, the nearest
    name, exit 2, nothing written."""
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[run]\nmodel = "llama_tin"\n[server]\nstate_dir = "state"\n[storage]\n'
        'endpoint_url = "http://127.0.0.1:9"\nbucket = "bucket"\naccess_key = "a"\n'
        'secret_key = "b"\n'
    )
    proc = sparseloco("coordinator", "--config", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert "run.model: unknown model preset 'llama_tin'; did you mean 'llama_tiny'?" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "state").exists()


def http(url: str, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_until(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_coordinator_starts_serves_tokens_and_stops(store: EmbeddedStore, tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_coordinator_config(
        tmp_path / "run.toml",
        run=RunConfig(name="cli", min_nodes=2),
        endpoint=store.endpoint,
        tokens={"n0": CONFIG_TOKEN},
        prefix="cli-test",
        state_dir=state,
    )
    log_path = tmp_path / "coordinator.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [str(SPARSELOCO), "coordinator", "--config", str(config), "--port", "0"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    try:
        wait_until("event=listening", lambda: "event=listening" in log_path.read_text())
        url = json.loads((state / "coordinator.json").read_text())["url"]

        added = sparseloco("coordinator", "token", "add", "n5", "--config", str(config))
        assert added.returncode == 0, added.stderr
        new_token = added.stdout.strip()
        assert len(new_token) >= 32 and "shown only now" in added.stderr
        again = sparseloco("coordinator", "token", "add", "n5", "--state-dir", str(state))
        assert again.returncode == 1 and "already has an active token" in again.stderr
        status, joined = http(url, "POST", "/v1/join", new_token, {})
        assert status == 200 and joined["node_id"] == "n5"

        listed = sparseloco("coordinator", "token", "list", "--config", str(config))
        assert listed.returncode == 0
        rows = {line.split()[0]: line.split()[1:3] for line in listed.stdout.splitlines()[1:]}
        assert rows == {"n0": ["active", "config"], "n5": ["active", "cli"]}
        assert new_token not in listed.stdout and CONFIG_TOKEN not in listed.stdout

        revoked = sparseloco("coordinator", "token", "revoke", "n5", "--config", str(config))
        assert revoked.returncode == 0 and "revoked 1 token of n5" in revoked.stdout
        status, err = http(url, "POST", "/v1/heartbeat", new_token)
        assert (status, err["error"]) == (401, "token_revoked")

        def n5_state() -> str | None:
            members = http(url, "GET", "/v1/status", None)[1]["members"]
            state_of = {m["node_id"]: m["state"] for m in members}
            return state_of["n5"] if state_of.get("n5") == "revoked" else None

        assert wait_until("n5 to be taken out", n5_state, timeout=10) == "revoked"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "event=stopped" in text and "event=revoked node=n5" in text
    assert CONFIG_TOKEN not in text and new_token not in text
    assert store.endpoint.secret_key not in text


def _coordinator_state(state: Path) -> str:
    """A coordinator state directory as a first start leaves it (database, signing key); the
    manifest public key (hex)."""
    from coordinator.state.db import Database
    from coordinator.state.schema import DB_FILE
    from coordinator.state.signing import ManifestSigner

    state.mkdir(parents=True)
    Database(state / DB_FILE).close()
    return ManifestSigner.load_or_create(state).public_key_hex


def test_token_add_invite_carries_url_token_and_key_and_the_tools_read_it(tmp_path: Path) -> None:
    from protocol.invite import Invite, decode_invite, key_fingerprint

    state = tmp_path / "state"
    public_key = _coordinator_state(state)
    config = tmp_path / "run.toml"
    config.write_text(f'[server]\nstate_dir = "{state}"\nhost = "0.0.0.0"\nport = 8700\n')

    # [server] listens everywhere: no URL to hand out, and no token spent on the way
    wildcard = sparseloco("coordinator", "token", "add", "n1", "--config", str(config), "--invite")
    assert wildcard.returncode == 1 and "pass --url" in wildcard.stderr and not wildcard.stdout

    url = "https://coord.example.org:8443"
    add = ("coordinator", "token", "add", "n1", "--config", str(config))
    made = sparseloco(*add, "--invite", "--url", url + "/")
    assert made.returncode == 0, made.stderr
    invite = decode_invite(made.stdout)
    assert invite.coordinator == url and invite.manifest_key == key_fingerprint(public_key)
    assert made.stdout.count("\n") == 1 and invite.token not in made.stderr
    assert key_fingerprint(public_key) in made.stderr

    plain = sparseloco("coordinator", "token", "add", "n2", "--state-dir", str(state))
    assert plain.returncode == 0 and len(plain.stdout.split()) == 1  # stdout: just the token
    assert key_fingerprint(public_key) in plain.stderr and plain.stdout.strip() not in plain.stderr

    # the tools take an invite: doctor dials its URL (nothing listens on port 9 here)
    local = Invite(
        coordinator="https://127.0.0.1:9", token="t" * 20, manifest_key=invite.manifest_key
    )
    doctor = sparseloco("doctor", "--invite", local.encode(), timeout=120)
    assert doctor.returncode == 1 and "https://127.0.0.1:9 did not answer" in doctor.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--invite", "not-an-invite"], "--invite: not a sparseloco invite"),
        (["--coordinator", "http://192.0.2.10:8700", "--token", "t"], "plain HTTP"),
        (["--coordinator", "http://localhots:8700", "--token", "t"], "does not resolve (a typo?)"),
        (
            [
                "--coordinator",
                "https://c.example",
                "--token",
                "t",
                "--manifest-key-fingerprint",
                "ab",
            ],
            "is not a manifest key fingerprint",
        ),
    ],
)
def test_node_refuses_a_bad_invite_or_plain_http_before_torch_loads(
    tmp_path: Path, args: list[str], says: str
) -> None:
    code = (
        "import sys; from node.cli import main;"
        f" rc = main(['node', *{args!r}, '--state-dir', 'x']); print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
