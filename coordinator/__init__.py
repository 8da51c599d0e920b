"""The coordinator service: membership, round state machine, gather sets, signed manifests.

It never imports ``node`` (the project's layering rule). Its modules live in rooms, one folder
per concern, listed from the bottom up: a module imports modules of its own room and of the
rooms below it, never of a room above (``tests/test_coordinator_rooms.py`` checks it)::

    base/        the exception tree, the config tree and its file, secrets kept out of output,
                 per-client limits (the config embeds them): what every other room stands on
    state/       the state directory: the SQLite database (tables, rows, typed reads and
                 writes, group commit), the manifest signing key, and backups of both
    rules/       the round rules and the state machine over the database: members, deadlines,
                 progress of the open round, votes, node tokens, checkpoint grants
    monitoring/  what the run looks like from outside: the status view, Prometheus metrics,
                 each node's series from its reports
    store/       the object store: its Protocol and boto3 backend, presigning, multipart
                 uploads, the outage watch, publishing, retention, verifying checkpoints,
                 datasets, learning closed rounds back at start
    api/         the HTTP service: the shared ``Coordinator``, auth and error mapping, route
                 handlers, upload grants, OpenAPI, long-poll wake-ups, ``create_app``, the
                 dashboard's static files
    ops/         running it: pre-flight checks, the server process, the operator's commands
                 (tokens, invites, backups)

    __main__.py  ``python -m coordinator``: the CLI, which dispatches to ``ops``

Each room's ``__init__.py`` says what lives there; ``docs/file-map.md`` has a line per module.
"""
