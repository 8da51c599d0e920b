"""The state directory: the database that is the run's single source of truth, and the key.

May import ``base``.

    schema.py           the SQLite tables and how the database file is opened (WAL)
    rows.py             the database's rows as frozen values
    db.py               typed reads and writes of the database (``Database``): the connection,
                        transactions, meta and members; one module per group of tables it
                        inherits:
    round_rows.py       the rounds (state, deadline, signed manifest, published)
    submission_rows.py  the submissions in arrival order, and the nodes' reports of rounds
    checkpoint_rows.py  checkpoint upload grants and committed checkpoints
    durability.py       group commit: answers wait for their commits to be on disk, one fsync
                        for many, off the event loop
    signing.py          the Ed25519 manifest key in the state directory
    backup.py           a consistent copy of the state directory in one file, and its restore
"""
