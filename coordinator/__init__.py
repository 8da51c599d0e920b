"""The coordinator service: membership, round state machine, gather sets, signed manifests.

Modules, one concept each (it never imports ``node``; DESIGN.md layering rules)::

    config.py     the config tree (TOML + env + flags) and its readable errors
    rounds.py     the round rules as pure functions (expected set, gather policy, deadlines)
    db.py         SQLite persistence (WAL), the single source of truth
    machine.py    the round state machine over the database (synchronous, injected clock)
    status.py     the run's status view for dashboards
    checkpoints.py  who uploads θ_R as a checkpoint, and when it counts as committed
    signing.py    the Ed25519 manifest key in the state directory
    storage.py    the object-store Protocol and its boto3 implementation (presigning, HEAD, PUT)
    publisher.py  uploads signed manifests, checkpoint sidecars and latest.json, retrying
    retention.py  deletes old payloads and checkpoints from the store
    metrics.py    Prometheus metrics
    openapi.py    the route table and the OpenAPI document generated from it
    handling.py   what every route shares: auth, body validation, error mapping
    app.py        the aiohttp route handlers and the app's background tasks
    server.py     running as a process: listen, announce, stop cleanly on a signal
    __main__.py   ``python -m coordinator`` CLI
"""
