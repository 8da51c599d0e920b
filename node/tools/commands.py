"""The ``store``, ``doctor``, ``export`` and ``data`` subcommands of ``sparseloco``: the tools, then
each one's ``Command`` row (``node.subcommand``).

``store`` runs the embedded S3-compatible store (SeaweedFS ``weed mini``) for a run on one
machine or a private network: every port bound to one address (loopback by default), the admin
UI, WebDAV and telemetry off, the bucket created, credentials from the environment.

``doctor`` and ``export`` take the coordinator's URL and a node token the same way
``sparseloco node`` does (``CONNECTION_FLAGS``, read by ``node.daemon.settings.load_connection``):
``--invite`` (or ``SPARSELOCO_NODE_INVITE``), or ``--coordinator`` and ``--token`` (better: the
environment variable ``SPARSELOCO_NODE_TOKEN``, where other users cannot read it from the
process list); ``--ca-cert`` for a coordinator whose certificate the system does not know, and
``--allow-insecure-http`` for plain HTTP to another machine on a trusted network.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from node.subcommand import Command, flag, values
from protocol.errors import ConfigError

if TYPE_CHECKING:  # imported when a command runs: the parser stays light
    from node.daemon.settings import ConnectionSettings


#: How to reach the coordinator and what to trust (``node``, ``doctor``, ``export``).
CONNECTION_FLAGS = (
    flag(
        "--invite",
        help="the invite from the run's operator: coordinator URL, token and manifest key"
        " fingerprint in one string (better: SPARSELOCO_NODE_INVITE)",
    ),
    flag("--coordinator", help="coordinator URL (or SPARSELOCO_NODE_COORDINATOR)"),
    flag("--token", help="a node token of the run (better: SPARSELOCO_NODE_TOKEN)"),
    flag(
        "--manifest-key-fingerprint",
        help="sha256:... of the run's manifest key, from the operator, when not using an invite"
        " (or SPARSELOCO_NODE_MANIFEST_KEY_FINGERPRINT)",
    ),
    flag(
        "--ca-cert",
        help="PEM file of the CA (or self-signed certificate) of the coordinator's TLS, added to"
        " the system store (or SPARSELOCO_NODE_CA_CERT)",
    ),
    flag(
        "--allow-insecure-http",
        action="store_true",
        default=None,
        help="allow plain http:// to another machine, on a network you trust"
        " (or SPARSELOCO_NODE_ALLOW_INSECURE_HTTP=1); loopback never needs it",
    ),
)


#: The connection flags' dests: the keywords of ``load_settings`` and ``load_connection``.
CONNECTION = (
    "invite",
    "coordinator",
    "token",
    "manifest_key_fingerprint",
    "ca_cert",
    "allow_insecure_http",
)


def connection_values(args: argparse.Namespace) -> dict[str, object]:
    """The connection flags as ``load_settings``/``load_connection`` keywords (None: not given)."""
    return values(args, *CONNECTION)


def _connection(args: argparse.Namespace) -> ConnectionSettings:
    from node.daemon.settings import load_connection

    return load_connection(**connection_values(args))


def _cmd_doctor(args: argparse.Namespace) -> int:
    connection = _connection(args)
    from node.tools.doctor import doctor

    state_dir = Path(args.state_dir) if args.state_dir else None
    return doctor(connection.coordinator, connection.token, state_dir, ca_cert=connection.ca_cert)


def _cmd_export(args: argparse.Namespace) -> int:
    import asyncio

    if args.run is not None:
        return _export_run(args)
    connection = _connection(args)
    token = connection.token
    if token is None:
        raise ConfigError(
            "export needs a node token of the run: --invite, --token or SPARSELOCO_NODE_TOKEN"
        )
    from node.tools.export import export

    done = asyncio.run(
        export(
            connection.coordinator,
            token,
            Path(args.out),
            ca_cert=connection.ca_cert,
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        )
    )
    info = done.info
    print(
        f"exported θ at the start of round {info.round} (fingerprint {info.fingerprint},"
        f" {info.size:,} bytes, verified) to {done.model}; run config in {done.manifest}"
        + (f"; tokenizer: {done.tokenizer}" if done.tokenizer else "")
    )
    return 0


def _export_run(args: argparse.Namespace) -> int:
    given = [flag for flag, value in connection_values(args).items() if value is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"--run exports without a coordinator: drop {flag}")
    from node.tools.offline import export_run

    done = export_run(
        Path(args.run), Path(args.out), Path(args.tokenizer) if args.tokenizer else None
    )
    print(
        f"exported θ after round {done['round'] - 1} of run {done['run_id']} (fingerprint"
        f" {done['fingerprint']}, verified) from {args.run} to {args.out}"
        + (f"; tokenizer: {done['tokenizer']}" if done["tokenizer"] else "")
    )
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    import signal
    import threading

    access = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret or len(secret) < 16:
        raise ConfigError(
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (16+ characters) in the environment:"
            " the store's admin credentials, the same as [storage] access_key and secret_key in"
            " the coordinator's config; e.g. export AWS_SECRET_ACCESS_KEY=$(openssl rand -hex 20)"
        )
    if args.host in ("0.0.0.0", "::"):
        raise ConfigError(
            "--host must be one address (the one nodes reach), not every interface: weed mini"
            " also opens an unauthenticated filer port on it"
        )
    from node.cluster.seaweed import EmbeddedStore

    store = EmbeddedStore(
        Path(args.dir),
        bucket=args.bucket,
        access_key=access,
        secret_key=secret,
        host=args.host,
        s3_port=args.port,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    endpoint = store.start()
    try:
        print(
            f"store ready: endpoint_url = {endpoint.endpoint_url!r}, bucket = {endpoint.bucket!r}"
            f" (data in {args.dir}; Ctrl-C stops it)",
            flush=True,
        )
        while not stop.wait(1.0):
            if store.process is None or store.process.poll() is not None:
                raise ConfigError(f"the store exited; see {Path(args.dir) / 'weed.log'}")
    finally:
        store.stop()
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    if args.upload and not (args.endpoint_url and args.bucket):
        raise ConfigError("--upload needs --endpoint-url and --bucket")
    from node.tools.shards import prepare, upload

    out = Path(args.out)
    manifest = prepare(
        args.inputs,
        out,
        column=args.column,
        tokenizer=args.tokenizer,
        train_vocab=args.train_bpe,
        shard_tokens=args.shard_tokens,
    )
    held = sum(1 for s in manifest.shards if s.split == "eval")
    print(
        f"dataset {manifest.dataset_id}: {manifest.total_tokens:,} tokens in"
        f" {len(manifest.shards)} shards ({held} held out for evaluation),"
        f" {manifest.tokenizer.kind} vocabulary of {manifest.tokenizer.vocab_size:,}; {out}"
    )
    if args.upload:
        root = upload(
            out, manifest, endpoint=args.endpoint_url, bucket=args.bucket, prefix=args.prefix
        )
        print(f"uploaded to s3://{args.bucket}/{root.rstrip('/')}/")
        print(
            f'a run trains on it with dataset = "{manifest.dataset_id}" in the [run] table of'
            f" the coordinator's config (its storage.prefix {args.prefix!r}, as here)"
        )
    return 0


DOCTOR = Command(
    "doctor",
    help="check that this machine can take part in a run, and how to fix what cannot",
    description="Checks the coordinator, the token, the clock, a presigned upload and"
    " download through the store (with bandwidth), disk, memory, threads and GPU."
    " Exit status 1 if any check fails.",
    run=_cmd_doctor,
    flags=(
        *CONNECTION_FLAGS,
        flag("--state-dir", help="the node's state folder, if it has one already"),
    ),
)

EXPORT = Command(
    "export",
    help="download the run's newest checkpoint as a verified safetensors file",
    description="Fetches the newest committed checkpoint through the coordinator, checks"
    " its sha256, its shapes against the run's model and its fingerprint against the one"
    " the nodes agreed on, and writes OUT/model.safetensors and OUT/run.json; for a"
    " LLaMA-style model OUT is also a Hugging Face transformers model (config.json) with"
    " its tokenizer (--tokenizer; the byte tokenizer for a byte-level model). With --run,"
    " the same from a run folder of `sparseloco up`, with no coordinator running.",
    run=_cmd_export,
    flags=(
        *CONNECTION_FLAGS,
        flag(
            "--run",
            metavar="RUN_DIR",
            help="export offline from a run folder of `sparseloco up` (its final model, kept in"
            " RUN_DIR/final), instead of asking a coordinator",
        ),
        flag("--out", required=True, help="folder for model.safetensors and run.json"),
        flag(
            "--tokenizer",
            help="the run's tokenizer: a tokenizer.json, or the folder `sparseloco data prepare`"
            " wrote (its manifest's sha256 is checked); default for a byte-level model: bytes",
        ),
    ),
)

STORE = Command(
    "store",
    help="run an S3-compatible object store (SeaweedFS) for a run, until Ctrl-C",
    description="Starts SeaweedFS `weed mini` with its data in --dir, every port bound to"
    " --host only, the admin UI off, and the bucket created. Credentials come from"
    " AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (put the same in the coordinator's"
    " [storage]). Nodes only need to reach the S3 port (presigned URLs). `sparseloco store"
    " check --help`: try what any S3-compatible store keeps of the project's promises.",
    run=_cmd_store,
    flags=(
        flag("--dir", required=True, help="data folder (kept across restarts)"),
        flag("--host", default="127.0.0.1", help="address to bind (default: loopback)"),
        flag("--port", type=int, default=8333, help="S3 port (default 8333)"),
        flag("--bucket", default="sparseloco"),
    ),
)

PREPARE = Command(
    "prepare",
    help="turn text into shards of token ids with a manifest (node.tools.shards)",
    description="Files, directories or globs (plain text; .jsonl: one document per line,"
    " .parquet: one per row, the text in --column) into"
    " fixed-size shards of token ids (bytes, a tokenizer.json, or a byte-level BPE trained"
    " here), every 20th shard held out for evaluation, with OUT/manifest.json; --upload"
    " copies them to the object store (credentials from AWS_ACCESS_KEY_ID and"
    " AWS_SECRET_ACCESS_KEY).",
    run=_cmd_data_prepare,
    flags=(
        flag("inputs", nargs="+", metavar="INPUT"),
        flag("--out", required=True, help="folder for the shards and manifest.json"),
        flag("--column", default="text", help="the text field of .jsonl/.parquet rows"),
        flag("--tokenizer", help="a Hugging Face tokenizer.json to use as it is"),
        flag("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE"),
        flag("--shard-tokens", type=int, default=1 << 20, help="ids per shard"),
        flag("--upload", action="store_true", help="copy to the object store"),
        flag("--endpoint-url", help="the store's S3 endpoint (with --upload)"),
        flag("--bucket", help="the store's bucket (with --upload)"),
        flag("--prefix", default="", help="key prefix of the run's objects"),
    ),
)


def add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="datasets: tokenised shards for runs")
    PREPARE.add_to(p.add_subparsers(dest="data", required=True, metavar="{prepare}"))
