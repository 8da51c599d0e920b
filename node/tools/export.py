"""``sparseloco export``: the run's newest checkpoint as a local, verified safetensors file.

Asks the coordinator for the newest committed checkpoint (``GET /v1/checkpoints/latest``, with
any valid node token: nothing is joined, nothing changes on the coordinator), downloads it
through the presigned GET to a file in a staging folder next to ``--out`` (``get_to_file``:
streamed, never held in memory), and keeps it only if every check holds:

- the bytes have the size and sha256 the coordinator recorded when the checkpoint was committed
  (checked by the download, which leaves no file otherwise);
- the file holds exactly the run's model, by names and shapes, in fp32 (safetensors holds only
  tensors, never code);
- the fingerprint of those tensors is the one the nodes agreed on for that round (the file read
  once more in chunks, ``protocol.fingerprint.digest_file``).

Nothing holds the whole model: the file is verified chunk by chunk and written out tensor by
tensor, so the process holds at most one tensor of it at a time (models larger than any one
process's memory export as they train).

Writes ``model.safetensors`` and ``run.json`` (run id, round, fingerprint, sha256, and the full
run config: the model preset and everything needed to rebuild the model) into ``--out``,
atomically, so a failed export never leaves a half-written model behind. For a LLaMA-style model
the folder is a Hugging Face ``transformers`` model (``node.tools.hf``: ``config.json``, the same
tensors under ``LlamaForCausalLM``'s names), which ``AutoModelForCausalLM.from_pretrained``
loads, with a tokenizer that ``AutoTokenizer.from_pretrained`` loads: ``--tokenizer`` (a
tokenizer.json, or the folder ``sparseloco data prepare`` wrote, whose manifest vouches for its
tokenizer.json by sha256), else the tokenizer of the dataset the run names (fetched from the
store, checked against the dataset id), else for a byte-level model (vocabulary 256) the exact
byte tokenizer.
The tokenizer is read before anything is fetched and checked against the run's model before
anything is written (``TokenizerError``).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from node.daemon.client import CoordinatorClient
from node.daemon.retry import RetryPolicy
from node.daemon.tls import connector
from node.daemon.transfer import HttpTransfers
from node.errors import CheckpointError, CoordinatorError, Refused
from node.tools.hf import (
    FileTensors,
    HfTokenizer,
    TokenizerError,
    byte_tokenizer,
    check_tokenizer,
    load_tokenizer,
    move_atomically,
    write_atomically,
    write_hf,
)
from protocol.dataset import MANIFEST_FILE, TOKENIZER_FILE, dataset_hex, parse_manifest
from protocol.errors import PayloadError
from protocol.fingerprint import CheckedFile, digest_file
from protocol.messages import CheckpointInfo
from protocol.runconfig import RunConfig
from protocol.status import StatusView

#: A tool answers quickly: a few tries, then it says the coordinator is not reachable.
TOOL_POLICY = RetryPolicy(attempts=4, base_s=0.5, max_delay_s=2.0, budget_s=20.0)
#: Most bytes of a tokenizer.json read from the store.
MAX_TOKENIZER_BYTES = 64 << 20
#: Beside the exported model: where it came from, the run's config, the tokenizer's source.
RUN_JSON = "run.json"


@dataclass(frozen=True)
class Exported:
    model: Path
    manifest: Path
    info: CheckpointInfo
    #: Where the tokenizer came from; None if the folder has none.
    tokenizer: str | None = None


def verify_checkpoint(path: Path, info: CheckpointInfo, run: RunConfig) -> CheckedFile:
    """What the checked file at ``path`` holds; ``CheckpointError`` unless it is the run's model
    with ``info.fingerprint``. Reads the file in chunks: never the whole model in memory."""
    import torch

    from node.compute.model import get_preset, model_class

    wrong_model = CheckpointError(
        f"checkpoint of round {info.round} does not hold the run's {run.model!r} model"
    )
    try:
        checked = digest_file(path)
    except PayloadError as exc:
        if exc.field.endswith(".dtype"):  # a well-formed file of another dtype
            raise wrong_model from exc
        raise CheckpointError(f"checkpoint of round {info.round} is unreadable: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read the downloaded checkpoint {path}: {exc}") from exc
    with torch.device("meta"):
        cfg = get_preset(run.model)
        model = model_class(cfg)(cfg)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = {name: shape for name, (_, shape, _, _) in checked.entries.items()}
    if got != expected:
        raise wrong_model
    if checked.fingerprint != info.fingerprint:
        raise CheckpointError(
            f"checkpoint of round {info.round} has fingerprint {checked.fingerprint}, the nodes"
            f" agreed on {info.fingerprint}"
        )
    return checked


async def export(
    coordinator: str,
    token: str,
    out: Path,
    *,
    ca_cert: Path | None = None,
    tokenizer: Path | None = None,
) -> Exported:
    """Fetch, verify and write the newest checkpoint; ``Refused`` if there is none, the token
    is refused or the TLS certificate is not trusted (``ca_cert`` adds a CA,
    ``node.daemon.tls``), ``CheckpointError``/``DigestError`` if it does not check out,
    ``TokenizerError`` if ``tokenizer`` cannot be read or does not fit the run's model."""
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    async with aiohttp.ClientSession(connector=connector(ca_cert)) as http:
        api = CoordinatorClient(http, coordinator, token, policy=TOOL_POLICY)
        status: StatusView = await api.status(rounds=1)
        if given is None and status.run.dataset is not None:
            given = await _dataset_tokenizer(api, http, status.run.dataset)
        tok = _tokenizer_for(status.run, given)
        try:
            view = await api.latest_checkpoint()
        except CoordinatorError as exc:
            if exc.status == 401:
                raise Refused(
                    f"the coordinator refused the token ({exc.error}); export needs any valid"
                    " node token of this run (--token or SPARSELOCO_NODE_TOKEN)"
                ) from exc
            raise
        if view is None:
            raise Refused(
                f"run {status.run_id} has no committed checkpoint yet (one is taken every"
                f" {status.run.checkpoint_every} rounds); try again later"
            )
        info = view.info
        out.parent.mkdir(parents=True, exist_ok=True)
        # Next to the output, so the verified file can be renamed into it.
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as staging:
            checkpoint = Path(staging) / "model.safetensors"
            await HttpTransfers(http).get_to_file(
                view.url, checkpoint, size=info.size, sha256=info.sha256
            )
            # Reading and writing the model are long and blocking: on a thread, off the loop.
            run = status.run
            checked = await asyncio.to_thread(verify_checkpoint, checkpoint, info, run)
            out.mkdir(parents=True, exist_ok=True)
            layout = await asyncio.to_thread(
                _write_model, checkpoint, checked, run, status.run_id, out, info, tok
            )
    note = "θ at the start of this round, i.e. after applying every round before it"
    write_run_json(out, layout, status.run_id, info, status.run, tok, note)
    source = tok.source if tok else None
    return Exported(out / "model.safetensors", out / RUN_JSON, info, source)


def write_run_json(
    out: Path,
    layout: str,
    run_id: str,
    info: CheckpointInfo,
    run: RunConfig,
    tok: HfTokenizer | None,
    note: str,
    **more: Any,
) -> dict[str, Any]:
    """``OUT/run.json`` beside the exported model: the checkpoint it came from (``note`` says
    which θ that is), the run's config and tokenizer, then ``more``; the document written."""
    document = {
        "format": layout,
        "run_id": run_id,
        "round": info.round,
        "fingerprint": info.fingerprint,
        "sha256": info.sha256,
        "size": info.size,
        "uploaded_by": info.node_id,
        "created_at": info.created_at,
        "note": note,
        "run": run.model_dump(mode="json"),
        "tokenizer": tok.source if tok else None,
        **more,
    }
    write_atomically(out / RUN_JSON, (json.dumps(document, indent=2) + "\n").encode())
    return document


async def _dataset_tokenizer(
    api: CoordinatorClient, http: aiohttp.ClientSession, dataset: str
) -> HfTokenizer:
    """The tokenizer of the run's dataset, from the store: the manifest (checked against the
    id the run names) and its tokenizer.json (checked against the manifest)."""
    view = await api.dataset()
    manifest = await HttpTransfers(http).get(
        view.manifest_url, size=view.manifest_size, sha256=dataset_hex(dataset)
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / MANIFEST_FILE).write_bytes(manifest)
        if parse_manifest(manifest, dataset).tokenizer.kind == "bpe":
            grant = await api.dataset_files([TOKENIZER_FILE])
            async with http.get(grant.urls[TOKENIZER_FILE]) as resp:
                resp.raise_for_status()
                data = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > MAX_TOKENIZER_BYTES:
                        break
            if len(data) > MAX_TOKENIZER_BYTES:
                raise TokenizerError(f"the dataset's tokenizer is over {MAX_TOKENIZER_BYTES} bytes")
            (folder / TOKENIZER_FILE).write_bytes(data)
        tok = load_tokenizer(folder)  # checks tokenizer.json's sha256 against the manifest
    return replace(tok, source=f"dataset {dataset}")


def _tokenizer_for(run: RunConfig, given: HfTokenizer | None) -> HfTokenizer | None:
    """The tokenizer to write with the run's model, checked against it: ``given``, else the
    byte tokenizer for a LLaMA-style byte-level model; None for another architecture (refused
    if one was given: only a ``transformers`` folder holds a tokenizer)."""
    from node.compute.model import get_preset

    cfg = get_preset(run.model)
    if cfg.arch != "llama":
        if given is not None:
            raise CheckpointError(
                f"only LLaMA-style models export to transformers with a tokenizer; this run's"
                f" model is {cfg.arch!r}"
            )
        return None
    tok = given if given is not None else byte_tokenizer() if cfg.vocab_size == 256 else None
    if tok is not None:
        check_tokenizer(tok, cfg)
    return tok


def _write_model(
    checkpoint: Path,
    checked: CheckedFile,
    run: RunConfig,
    run_id: str,
    out: Path,
    info: CheckpointInfo,
    tokenizer: HfTokenizer | None = None,
) -> str:
    """The verified checkpoint into ``out``: for a LLaMA-style model as a ``transformers``
    directory (``node.tools.hf``, written tensor by tensor from the file), else the file as it
    is (moved there); which of the two."""
    from node.compute.model import get_preset

    cfg = get_preset(run.model)
    if cfg.arch != "llama":
        move_atomically(checkpoint, out / "model.safetensors")
        return "safetensors"
    meta = {"run_id": run_id, "round": str(info.round), "fingerprint": info.fingerprint}
    write_hf(FileTensors(checkpoint, checked), cfg, out, meta, tokenizer)
    return "transformers"
