"""A run's final model kept in its run folder, and exported from there without a coordinator.

``sparseloco up`` stops its coordinator and store at the end, so ``sparseloco export`` (which
asks a coordinator) has nothing to ask. Instead, once every node has finished, ``keep_final``
puts into ``RUN_DIR/final/``:

- ``model.safetensors``: θ after the run's last round, assembled from a node's saved state
  (``node.compute.state``: ``theta-{R}.safetensors``, or one file per rank for a node of several
  processes) in the checkpoint layout (``node.compute.checkpoint``: header, then every tensor in
  name order), one rank's tensors at a time;
- ``final.json``: the run id, that round, the fingerprint the nodes agreed on for it (from the
  coordinator's status, not from the node's own file) and the full run config;
- ``dataset/``: for a run on a prepared dataset, its ``manifest.json`` and ``tokenizer.json``
  (the manifest vouches for the tokenizer by sha256), so the export finds the tokenizer offline.

``export_run`` (``sparseloco export --run RUN_DIR``, and ``up --export DIR``) then checks the
kept file exactly as ``node.tools.export`` checks a downloaded checkpoint (names, shapes, fp32,
and its fingerprint against the agreed one) and writes the same folder: ``model.safetensors``
and ``run.json``, for a LLaMA-style model a ``transformers`` model with its tokenizer.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from node.errors import CheckpointError
from protocol.dataset import MANIFEST_FILE, TOKENIZER_FILE
from protocol.errors import PayloadError
from protocol.fingerprint import digest_file
from protocol.messages import CheckpointInfo, RoundState
from protocol.runconfig import RunConfig
from protocol.status import StatusView

log = logging.getLogger("sparseloco.up")

#: The folder of the run folder that holds the final model.
FINAL_DIR = "final"
FINAL_JSON = "final.json"
MODEL_FILE = "model.safetensors"
#: The node's commit file (``node.compute.state.STATE_FILE``) and the most header bytes read.
STATE_FILE = "state.safetensors"
MAX_HEADER_BYTES = 1 << 20


def keep_final(
    run_dir: Path,
    run: RunConfig,
    run_id: str,
    fingerprint: str,
    node_dirs: list[Path],
    data: str | None = None,
) -> Path:
    """Write ``run_dir/final/`` (see module doc) from the first node in ``node_dirs`` whose
    saved state is θ after the last round with ``fingerprint``; its path. ``CheckpointError``
    if no node holds it. A node of one process saved θ as one file: it is copied and its
    fingerprint checked without torch (the launcher never loads it)."""
    final = run_dir / FINAL_DIR
    final.mkdir(parents=True, exist_ok=True)
    path = final / MODEL_FILE
    for state_dir in node_dirs:
        header = _state_header(state_dir)
        if header is None or header.get("round") != run.rounds:
            continue
        world = int(header.get("world", 1))
        parts = [state_dir / _theta_file(run.rounds, k, world) for k in range(world)]
        if header.get("fingerprint") != fingerprint or not all(p.is_file() for p in parts):
            continue
        if world == 1:
            shutil.copyfile(parts[0], path)
        else:
            _join_ranks(parts, run, run_id, path)
        try:
            checked = digest_file(path, sha256=True)
        except (OSError, PayloadError):
            continue
        if checked.fingerprint != fingerprint:
            continue
        info = {
            "run_id": run_id,
            "round": run.rounds,
            "fingerprint": fingerprint,
            "sha256": checked.sha256,
            "size": checked.size,
            "node_id": str(header["node_id"]),
            "created_at": time.time(),
            "run": run.model_dump(mode="json"),
        }
        (final / FINAL_JSON).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if data is not None and (Path(data) / MANIFEST_FILE).is_file():
            kept = final / "dataset"
            kept.mkdir(exist_ok=True)
            for name in (MANIFEST_FILE, TOKENIZER_FILE):
                if (Path(data) / name).is_file():
                    shutil.copyfile(Path(data) / name, kept / name)
        return final
    path.unlink(missing_ok=True)
    raise CheckpointError(
        f"no node's saved state holds θ after round {run.rounds - 1} with fingerprint"
        f" {fingerprint}; the final model was not kept"
    )


def keep_agreed(
    run_dir: Path, run: RunConfig, status: StatusView, node_dirs: list[Path], data: str | None
) -> str | None:
    """``keep_final`` with the fingerprint the nodes agreed on after the last round, from the
    coordinator's final ``status``; the folder, or None (logged) when they did not agree."""
    last = [r for r in status.rounds if r.state == RoundState.CLOSED and r.round == run.rounds - 1]
    agreed = set(last[0].fingerprints.values()) if last else set()
    if len(agreed) != 1:
        log.warning("event=final_model_not_kept why=no_agreed_fingerprint rounds=%d", run.rounds)
        return None
    final = keep_final(run_dir, run, status.run_id, agreed.pop(), node_dirs, data)
    log.info("event=final_model_kept path=%s", final)
    return str(final)


def _state_header(state_dir: Path) -> dict[str, Any] | None:
    """The header a node committed (``node.compute.state``), read from the safetensors header
    as plain JSON; None if there is none or it is unreadable."""
    try:
        with open(state_dir / STATE_FILE, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > MAX_HEADER_BYTES:
                return None
            meta = json.loads(f.read(n))["__metadata__"]
        header = json.loads(meta["sparseloco"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return header if isinstance(header, dict) else None


def _theta_file(round_: int, rank: int, world: int) -> str:
    """``node.compute.state.shard_file(THETA_PATTERN, ...)``, without importing torch."""
    name = f"theta-{round_}.safetensors"
    return name if world == 1 else name.replace(".safetensors", f".rank{rank}.safetensors")


def _join_ranks(parts: list[Path], run: RunConfig, run_id: str, path: Path) -> None:
    """θ of a node of several processes, one file per rank, as one file in the checkpoint
    layout; one rank's tensors in memory at a time."""
    from safetensors.torch import load_file

    from node.compute.files import SafetensorsLayout
    from node.compute.model import get_preset, model_shapes

    plan = SafetensorsLayout.of(model_shapes(get_preset(run.model)), {"run_id": run_id})
    plan.create(path)
    for part in parts:
        plan.write_tensors(path, load_file(str(part)))


def read_final(run_dir: Path) -> tuple[Path, CheckpointInfo, RunConfig]:
    """The kept model file, its info and the run config; ``CheckpointError`` naming what is
    missing when ``run_dir`` holds no final model."""
    final = run_dir / FINAL_DIR
    try:
        doc = json.loads((final / FINAL_JSON).read_text(encoding="utf-8"))
        run = RunConfig.model_validate(doc["run"])
        info = CheckpointInfo(
            run_id=doc["run_id"],
            round=doc["round"],
            fingerprint=doc["fingerprint"],
            key=str(final / MODEL_FILE),
            sha256=doc["sha256"],
            size=doc["size"],
            node_id=doc["node_id"],
            created_at=doc["created_at"],
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{run_dir} holds no final model ({final / FINAL_JSON}: {exc}); it is written by"
            " `sparseloco up` when a run finishes"
        ) from exc
    if info.run_id != run.run_id:
        raise CheckpointError(f"{final / FINAL_JSON}: run id {info.run_id} is not its run's")
    return final / MODEL_FILE, info, run


def export_run(run_dir: Path, out: Path, tokenizer: Path | None = None) -> dict[str, Any]:
    """Export ``run_dir``'s final model into ``out`` (see module doc); the ``run.json`` written.

    ``tokenizer`` as in ``node.tools.export.export``; by default the run's dataset kept in the
    run folder, else the byte tokenizer for a byte-level LLaMA-style model."""
    from node.compute.checkpoint import sha256_file
    from node.tools.export import _tokenizer_for, _write_model, verify_checkpoint, write_run_json
    from node.tools.hf import load_tokenizer

    model, info, run = read_final(run_dir)
    kept = run_dir / FINAL_DIR / "dataset"
    if tokenizer is None and run.dataset is not None and (kept / MANIFEST_FILE).is_file():
        tokenizer = kept
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    if given is not None and tokenizer == kept:  # said as the online export says it
        given = replace(given, source=f"dataset {run.dataset}")
    tok = _tokenizer_for(run, given)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as staging:
        copy = Path(staging) / MODEL_FILE  # _write_model moves a plain file: never the kept one
        shutil.copyfile(model, copy)
        if sha256_file(copy) != info.sha256:
            raise CheckpointError(f"{model} changed since the run kept it (sha256 differs)")
        checked = verify_checkpoint(copy, info, run)
        layout = _write_model(copy, checked, run, info.run_id, out, info, tok)
    note = "θ after the run's last round, kept in the run folder by `sparseloco up`"
    return write_run_json(out, layout, info.run_id, info, run, tok, note, source=str(run_dir))
