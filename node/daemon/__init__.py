"""The networked node: DESIGN.md's round loop against a real coordinator and object store.

``loop`` is the daemon (``NodeDaemon``; ``serve.run_node`` runs it over HTTP; ``lifetime``: its
heartbeat and how a stop ends its work; ``resync``: when resynchronising stops helping): it
drives a ``compute.worker.Worker`` through the rounds, talking to the coordinator through the
``api.CoordinatorApi`` seam (``client`` is the HTTP implementation) and to the object store
through the ``api.Transfers`` seam (``transfer``: presigned PUT/GET with aiohttp; ``ranged``:
a byte range resumed after a reset; ``multipart``: uploads in parts; ``filestream``: their disk
side; ``transferopts``: the timeouts, retries, cap and tally every transfer runs under).
``rounds`` holds the round's steps after training: wait, verify, download, decode, apply,
account, save, report; ``overlap`` trains the next round while a round's payloads travel (the run's
``overlap``); ``upload`` sends a trained round; ``host`` is what these steps use of the daemon
(Protocols: they never import ``loop``). ``gather`` fetches and validates a closed round's
gather set, ``checkpoints`` offers and restores checkpoints, ``retry`` bounds every retry,
``settings`` is the node's config and ``faults`` the chaos suite's fault injection. ``join``
joins the run and settles the manifest key to trust (``pinning``: the invite's fingerprint, the
key pinned in the state dir);
``tls`` is how the coordinator is reached safely (CA bundle, plain HTTP only to loopback unless
allowed, untrusted certificates refused). ``ranks`` runs one node as several processes under
torchrun (rank 0 is the daemon, the others help with the inner steps).
"""
