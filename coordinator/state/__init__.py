"""The state directory: the database that is the run's single source of truth, and the key.

May import ``base``.

    schema.py           the SQLite tables and how the database file is opened (WAL)
    rows.py             the database's rows as frozen values
    db.py               typed reads and writes of the database (``Database``)
    checkpoint_rows.py  the checkpoint tables' part of it (grants, committed checkpoints)
    durability.py       group commit: answers wait for their commits to be on disk, one fsync
                        for many, off the event loop
    signing.py          the Ed25519 manifest key in the state directory
    backup.py           a consistent copy of the state directory in one file, and its restore
"""
