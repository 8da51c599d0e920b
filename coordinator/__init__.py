"""The coordinator service: membership, round state machine, gather sets, signed manifests.

Modules, one concept each (it never imports ``node``; DESIGN.md layering rules)::

    errors.py       the coordinator's exception tree (and which errors are transient)
    config.py       the config tree (TOML + env + flags) and its readable errors
    rounds.py       the round rules as pure functions (round in progress, expected set, gather
                    policy, deadlines)
    schema.py       the SQLite tables and how the database file is opened (WAL)
    db.py           typed reads and writes of the database, the single source of truth
    membership.py   members: join, heartbeat, leave, timeouts, last heartbeat times
    machine.py      the round state machine over the database (synchronous, injected clock)
    status.py       the run's status view for dashboards (reads only)
    checkpoints.py  who uploads θ_R as a checkpoint, and when it counts as committed
    signing.py      the Ed25519 manifest key in the state directory
    storage.py      the object-store Protocol and its boto3 implementation (the only botocore
                    import: its errors leave as StorageError)
    publisher.py    uploads signed manifests, checkpoint sidecars and latest.json, retrying
    retention.py    deletes old payloads and checkpoints from the store
    metrics.py      Prometheus metrics
    openapi.py      the OpenAPI document generated from ``protocol.routes``
    handling.py     what every route shares: auth, body validation, error mapping
    service.py      the ``Coordinator`` every handler shares, and what follows a round's close
    handlers.py     the aiohttp route handlers, by endpoint name
    app.py          ``create_app``: wiring, route registration, background tasks' lifecycle
    server.py       running as a process: listen, announce, stop cleanly on a signal
    __main__.py     ``python -m coordinator`` CLI
"""
