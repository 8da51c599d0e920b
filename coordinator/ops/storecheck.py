"""``sparseloco store check``: what an S3-compatible store keeps of the project's promises.

Against the coordinator's own ``[storage]`` (``--config run.toml``, the environment overriding it
as for the coordinator) or an endpoint named by flags (credentials from ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, as ``sparseloco store`` takes them), it checks the bucket, runs the
probes of ``coordinator.store.conformance`` under ``{prefix}store-check-<id>/`` (deleted
afterwards) and prints one table: each promise, whether the store kept it, what it did, and what
the project does about it; then what a coordinator started on this store would do.

Exit status: 0 if a coordinator would start on this store (with this config's
``storage.accept_unbound_uploads``), 1 if it would refuse (the reasons printed), 2 for bad flags
or config. Nothing printed carries a secret.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from coordinator.base.config import StorageConfig, load_config
from coordinator.base.errors import StartupError, StorageError
from coordinator.base.redact import scrub
from coordinator.ops.preflight import store_problem
from coordinator.store.conformance import check_promises
from coordinator.store.promises import Report
from coordinator.store.storage import S3Store
from protocol.errors import ConfigError


def parse_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Try every promise the project relies on against an S3-compatible store"
        " (signed length and sha256 on uploads and parts, altered and expired URLs,"
        " If-None-Match on PUT and CompleteMultipartUpload, a part under 5 MiB, a ranged GET,"
        " a listing, DeleteObjects) with throwaway keys, print what it did and what the"
        " coordinator does about it, and delete the keys. Exit status 0: a coordinator would"
        " start on it; 1: it would refuse; 2: bad flags or config.",
    )
    parser.add_argument(
        "--config",
        help="the coordinator's TOML file: check its [storage] (the environment overrides it)",
    )
    parser.add_argument("--endpoint-url", help="the store's S3 endpoint (without --config)")
    parser.add_argument("--bucket", help="the bucket (without --config)")
    parser.add_argument("--prefix", default="", help="key prefix to work under (default: none)")
    parser.add_argument("--region", default="us-east-1", help="region (default us-east-1)")
    return parser.parse_args(argv)


def storage_of(args: argparse.Namespace) -> StorageConfig:
    """The ``[storage]`` to check: the config file's, or one made of the flags."""
    if args.config is not None:
        if args.endpoint_url or args.bucket:
            raise ConfigError("give --config or --endpoint-url and --bucket, not both")
        return load_config(args.config).storage
    if not (args.endpoint_url and args.bucket):
        raise ConfigError("give --config run.toml, or --endpoint-url and --bucket")
    access = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise ConfigError(
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment (the store's"
            " credentials), or give --config with the coordinator's [storage]"
        )
    try:
        return StorageConfig(
            endpoint_url=args.endpoint_url,
            bucket=args.bucket,
            prefix=args.prefix,
            region=args.region,
            access_key=access,
            secret_key=secret,
        )
    except ValueError as exc:
        raise ConfigError(f"bad flags: {exc}") from None


async def run_check(storage: StorageConfig) -> Report:
    store = S3Store(
        endpoint_url=storage.endpoint_url,
        bucket=storage.bucket,
        access_key=storage.access_key,
        secret_key=storage.secret_key,
        region=storage.region,
    )
    try:
        try:
            await store.check_bucket()
        except StorageError as exc:
            raise StartupError(
                store_problem(exc, "head bucket", storage.endpoint_url, storage.bucket)
            ) from exc
        prefix = storage.prefix.strip("/")
        try:
            return await check_promises(store, f"{prefix}/" if prefix else "")
        except StorageError as exc:
            raise StartupError(
                store_problem(exc, "store check", storage.endpoint_url, storage.bucket)
            ) from exc
    finally:
        await store.close()


def verdict(report: Report, storage: StorageConfig) -> tuple[int, list[str]]:
    """The exit status and the lines that say what a coordinator would do on this store."""
    accept = storage.accept_unbound_uploads
    problems = report.profile.problems(accept_unbound=accept)
    if problems:
        return 1, [f"a coordinator would refuse to start: {p}" for p in problems]
    lines = [f"a coordinator would start, with: {f}" for f in report.profile.fallbacks(
        accept_unbound=accept
    )]  # fmt: skip
    if lines:
        return 0, lines
    if all(f.kept for f in report.findings):
        return 0, ["a coordinator would start: every promise is kept"]
    return 0, ["a coordinator would start: what the store does not keep, the project does not need"]


def main(argv: Sequence[str], *, prog: str) -> int:
    args = parse_args(argv, prog)
    secrets: set[str] = set()
    try:
        storage = storage_of(args)
        secrets = {storage.access_key, storage.secret_key}
        where = f"{storage.endpoint_url} bucket {storage.bucket!r}"
        print(f"store check: {where}, prefix {storage.prefix!r}", flush=True)
        report = asyncio.run(run_check(storage))
    except ConfigError as exc:
        print(f"error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 1
    code, lines = verdict(report, storage)
    print(report.table())
    print()
    for line in lines:
        print(line)
    print("(what each provider keeps, and their [storage] settings: docs/stores.md)")
    return code
