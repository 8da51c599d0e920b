"""A coordinator's state in one file: a consistent copy taken while it runs, and its restore.

The state directory holds two things a run cannot do without: the SQLite database (members,
tokens, rounds and their signed manifests, checkpoints) and the manifest signing key, which
every node pinned at its first join. ``take_backup`` copies the database with SQLite's online
backup API (``sqlite3.Connection.backup``): it reads one snapshot inside a read transaction, so
the copy is the database as of one commit even while the coordinator writes (in WAL mode a
reader blocks no writer). The copy is checked (``PRAGMA integrity_check``) and packed, with the
key and a small ``backup.json`` (run, round, when, the key's public fingerprint), into one
gzipped tar written atomically with mode 0600: it holds the private key, so only its owner may
read it. Nothing prints the key.

``restore_backup`` unpacks such a file into a new state directory (refusing one that already
holds a database or a key): the database and the key, mode 0600, checked again. A coordinator
started on it with the run's config continues the run; the rounds closed after the backup was
taken are learnt from the signed manifests in the object store at start
(``coordinator.store.catchup``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from coordinator.base.errors import BackupError
from coordinator.state.schema import DB_FILE
from coordinator.state.signing import KEY_FILE, ManifestSigner
from protocol.errors import ConfigError
from protocol.invite import key_fingerprint

#: What ``backup.json`` says the file is, and the layout's version.
FORMAT = "sparseloco-coordinator-backup"
VERSION = 1
INFO_FILE = "backup.json"
#: The archive's members, and nothing else: a restore writes only these, by these names.
MEMBERS = (INFO_FILE, DB_FILE, KEY_FILE)
#: How long the copy waits for a lock SQLite cannot share (only a schema change holds one).
BUSY_TIMEOUT_S = 30.0
#: Largest ``backup.json`` / key a restore reads into memory.
SMALL_MEMBER_BYTES = 64 * 1024


@dataclass(frozen=True)
class BackupInfo:
    """What ``backup.json`` records about a backup."""

    run_id: str
    #: The newest round in the copy and its state (``open``, ``waiting``, ``closed``).
    round: int
    round_state: str
    taken_at: float
    schema_version: int
    #: ``sha256:<hex>`` of the manifest key's public half (what invites carry; not a secret).
    manifest_key: str
    format: str = FORMAT
    version: int = VERSION

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(self.taken_at))
        return (
            f"run {self.run_id} at round {self.round} ({self.round_state}), taken {when},"
            f" manifest key {self.manifest_key}"
        )


def snapshot(db_path: Path, dest: Path) -> None:
    """Copy the database at ``db_path`` (perhaps being written) into a new file ``dest``, as of
    one commit."""
    try:
        src = sqlite3.connect(db_path, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open {db_path}: {exc}") from exc
    try:
        dst = sqlite3.connect(dest)
        try:
            src.backup(dst)  # all pages in one step: one read transaction, one snapshot
            # The copy keeps the live file's WAL mode; one file is what an archive wants.
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
    except sqlite3.Error as exc:
        raise BackupError(f"copying {db_path} failed: {exc}") from exc
    finally:
        src.close()


def _describe_db(path: Path, fingerprint: str, taken_at: float) -> BackupInfo:
    """What the database copy at ``path`` holds, once SQLite's integrity check passes."""
    conn = sqlite3.connect(path)
    try:
        (verdict,) = conn.execute("PRAGMA integrity_check").fetchone()
        if verdict != "ok":
            raise BackupError(f"{path} fails SQLite's integrity check: {verdict}")
        run = conn.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
        newest = conn.execute("SELECT round, state FROM rounds ORDER BY round DESC LIMIT 1")
        row = newest.fetchone()
        (schema,) = conn.execute("PRAGMA user_version").fetchone()
    except sqlite3.Error as exc:
        raise BackupError(f"{path} is not a coordinator database: {exc}") from exc
    finally:
        conn.close()
    if run is None or row is None:
        raise BackupError(f"{path} holds no run yet: start the coordinator once first")
    return BackupInfo(
        run_id=str(run[0]),
        round=int(row[0]),
        round_state=str(row[1]),
        taken_at=taken_at,
        schema_version=int(schema),
        manifest_key=fingerprint,
    )


def _fingerprint(state_dir: Path) -> str:
    """The public fingerprint of the key in ``state_dir`` (which must exist and load)."""
    try:
        return key_fingerprint(ManifestSigner.load_or_create(state_dir).public_key_hex)
    except ConfigError as exc:
        raise BackupError(str(exc)) from exc


def _private_file(path: Path) -> int:
    """A new file at ``path``, mode 0600 from its creation on; its descriptor."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask
    return fd


def _add(tar: tarfile.TarFile, name: str, data: IO[bytes], size: int) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = size, 0o600, int(time.time())
    tar.addfile(member, data)


def take_backup(state_dir: Path, out: Path) -> BackupInfo:
    """Write a consistent backup of the coordinator state in ``state_dir`` to ``out`` (mode
    0600, replaced atomically if it exists), running coordinator or not."""
    db_path, key_path = state_dir / DB_FILE, state_dir / KEY_FILE
    for path, what in ((db_path, "database"), (key_path, "manifest signing key")):
        if not path.is_file():
            raise BackupError(
                f"no coordinator {what} at {path}: fix --state-dir / --config (the state"
                " directory a coordinator of this run has started in)"
            )
    if out.is_dir():
        raise BackupError(f"--out {out} is a directory; name the backup file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(state_dir)
    key = key_path.read_bytes()
    with tempfile.TemporaryDirectory(prefix=".sparseloco-backup-", dir=out.parent) as tmp:
        copy = Path(tmp) / DB_FILE  # a 0700 folder: the copy holds token digests
        taken_at = time.time()
        snapshot(db_path, copy)
        info = _describe_db(copy, fingerprint, taken_at)
        meta = json.dumps(asdict(info), indent=1).encode()
        partial = Path(tmp) / "backup.tar.gz"
        with os.fdopen(_private_file(partial), "wb") as f:
            with tarfile.open(fileobj=f, mode="w:gz") as tar:
                _add(tar, INFO_FILE, io.BytesIO(meta), len(meta))
                with copy.open("rb") as db:
                    _add(tar, DB_FILE, db, copy.stat().st_size)
                _add(tar, KEY_FILE, io.BytesIO(key), len(key))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out)
    return info


def read_info(tar: tarfile.TarFile, archive: Path) -> BackupInfo:
    """The ``backup.json`` of an opened archive, checked to be one of ours."""
    raw = _small(tar, INFO_FILE, archive)
    try:
        values = json.loads(raw)
        info = BackupInfo(**values)
    except (ValueError, TypeError) as exc:
        raise BackupError(f"{archive}: {INFO_FILE} is damaged ({exc})") from exc
    if info.format != FORMAT or info.version != VERSION:
        raise BackupError(
            f"{archive} is a {info.format} v{info.version} file; this sparseloco reads"
            f" {FORMAT} v{VERSION}"
        )
    return info


def _member(tar: tarfile.TarFile, name: str, archive: Path) -> IO[bytes]:
    try:
        member = tar.getmember(name)
    except KeyError:
        raise BackupError(f"{archive} has no {name}: it is not a coordinator backup") from None
    f = tar.extractfile(member) if member.isfile() else None
    if f is None:
        raise BackupError(f"{archive}: {name} is not a regular file")
    return f


def _small(tar: tarfile.TarFile, name: str, archive: Path) -> bytes:
    data = _member(tar, name, archive).read(SMALL_MEMBER_BYTES + 1)
    if len(data) > SMALL_MEMBER_BYTES:
        raise BackupError(f"{archive}: {name} is larger than any real one")
    return data


def restore_backup(archive: Path, state_dir: Path) -> BackupInfo:
    """Unpack ``archive`` into ``state_dir`` (created; it must hold no coordinator state)."""
    if (state_dir / DB_FILE).exists():
        raise BackupError(
            f"{state_dir} already holds a coordinator database: restore into a new, empty"
            " --state-dir (never over a coordinator's state)"
        )
    try:
        tar = tarfile.open(archive, "r:gz")  # noqa: SIM115 (closed by the with below)
    except (OSError, tarfile.TarError) as exc:
        raise BackupError(f"cannot read {archive} as a coordinator backup: {exc}") from exc
    with tar:
        info = read_info(tar, archive)
        key = _small(tar, KEY_FILE, archive)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(prefix=".restore-", dir=state_dir) as tmp:
            db_tmp, key_tmp = Path(tmp) / DB_FILE, Path(tmp) / KEY_FILE
            with os.fdopen(_private_file(db_tmp), "wb") as f:
                shutil.copyfileobj(_member(tar, DB_FILE, archive), f)
                os.fsync(f.fileno())
            with os.fdopen(_private_file(key_tmp), "wb") as f:
                f.write(key)
                os.fsync(f.fileno())
            found = _describe_db(db_tmp, _fingerprint(Path(tmp)), info.taken_at)
            if (found.run_id, found.manifest_key) != (info.run_id, info.manifest_key):
                raise BackupError(f"{archive} is damaged: its parts belong to different runs")
            key_path = state_dir / KEY_FILE
            if key_path.exists() and _fingerprint(state_dir) != info.manifest_key:
                raise BackupError(
                    f"{key_path} is another manifest key than the backup's: restore into a"
                    " new, empty --state-dir"
                )
            # The key first: a coordinator started on a database without its key would make
            # a new one, which no node trusts; a key alone is replaced by a rerun.
            os.replace(key_tmp, key_path)
            os.replace(db_tmp, state_dir / DB_FILE)
    return info
