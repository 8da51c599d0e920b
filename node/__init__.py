"""The participant: everything one node of a SparseLoCo run does, in five rooms.

::

    compute/    the numbers: model, data, inner AdamW, the SparseLoCo outer step, the worker that
                runs a round's compute, and the atomic local state. No network I/O.
    daemon/     the networked node: the round loop against a coordinator and an object store,
                the coordinator client, presigned transfers, retries, gather sets, checkpoints,
                settings and fault injection for the chaos suite.
    research/   tools for people studying the algorithm: the in-process simulator, progress
                display, and the benchmarks (codec, quality, networked round).
    cluster/    ``sparseloco up``: an embedded SeaweedFS store, a coordinator and N nodes as real
                processes on this machine, with a live view.
    tools/      commands beside the daemon: ``store`` (the embedded store for a real run),
                ``doctor`` (can this machine take part?) and ``export`` (the verified model).
    cli.py      the ``sparseloco`` command; ``subcommand.py`` a subcommand as data (flags, help,
                what it runs); ``errors.py`` the node's exception tree;
    corpus/     the bundled demo corpus (public-domain plays).

Layering: ``compute`` imports only ``protocol``; ``daemon`` builds on ``compute``; ``research``,
``cluster`` and ``tools`` build on both. Nothing here imports ``coordinator``.
"""
