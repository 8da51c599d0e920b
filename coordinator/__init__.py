"""The coordinator service: membership, round state machine, gather sets, signed manifests.

Modules, one concept each (it never imports ``node``: the project's layering rule)::

    errors.py       the coordinator's exception tree (and which errors are transient)
    config.py       the config tree (TOML + env + flags) and its readable errors
    rounds.py       the round rules as pure functions (round in progress, expected and waited-for
                    sets, gather policy, deadlines learnt from honest arrivals)
    schema.py       the SQLite tables and how the database file is opened (WAL)
    rows.py         the database's rows as frozen values
    db.py           typed reads and writes of the database, the single source of truth
    checkpoint_rows.py  the checkpoint tables' part of it (grants, committed checkpoints)
    durability.py   group commit: answers wait for their commits to be on disk, one fsync for
                    many, off the event loop
    membership.py   members: join, heartbeat, leave, timeouts, revocation, the end of the run,
                    last heartbeat times, the process each active member is bound to
    tokens.py       node tokens: sha256 digests in the database, seeding rule, checked on every
                    request, reloaded when the operator changes them
    machine.py      the round state machine over the database (synchronous, injected clock)
    progress.py     the open round's submitters and missing members in memory (the close check)
    votes.py        the nodes' reports of closed rounds: only a round's participants vote
    status.py       the run's status view for dashboards (reads only)
    checkpoints.py  who uploads θ_R as a checkpoint (members only), and when it is committed
    verify.py       reading an uploaded checkpoint back and verifying it before the commit
    signing.py      the Ed25519 manifest key in the state directory
    storage.py      the object-store Protocol and its boto3 implementation (the only botocore
                    import: its errors leave as StorageError)
    presign.py      presigned URLs (SigV4) in microseconds, used once shown equal to boto3's
    multipart.py    multipart uploads on the store: create, presign parts, complete write-once,
                    abort the stale
    uploads.py      upload grants (one PUT, or a URL per part) and completing an upload
    publisher.py    uploads signed manifests, checkpoint sidecars and latest.json, retrying
    retention.py    deletes old payloads and checkpoints from the store
    metrics.py      Prometheus metrics; the run's counters start from the database's totals
    node_metrics.py each node's series (losses, timings, rates, bytes, retries) from its reports
    openapi.py      the OpenAPI document generated from ``protocol.routes``
    redact.py       secrets never printed: masked values in errors, a filter for log lines
    limits.py       per-client limits: rate limits (failed auth per address, requests per node),
                    body and request-head timeouts, aiohttp's connection settings
    handling.py     what every route shares: auth, body validation, query checks, error mapping
    service.py      the ``Coordinator`` every handler shares, and what follows a round's close
    wakeups.py      long-polls woken a batch per turn of the event loop (a close wakes ~N)
    handlers.py     the aiohttp route handlers, by endpoint name (``dashboard/``: the page at ``/``)
    app.py          ``create_app``: wiring, route registration, background tasks' lifecycle
    preflight.py    checks before anything is written: the port, the object store
    server.py       running as a process: check, listen, announce, stop cleanly on a signal
    admin.py        ``coordinator token add|list|revoke``: the operator's token commands
    invite.py       what an invite needs besides the token: the public URL, the key fingerprint
    __main__.py     ``python -m coordinator`` CLI
"""
