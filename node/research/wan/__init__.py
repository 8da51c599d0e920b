"""The commodity internet on one machine: shaped, delayed and flaky links between nodes and the
store (issue 20).

``profiles`` names the links (home, office, far, flaky); ``relay`` is the userspace TCP relay
that adds delay, jitter, slow start and resets (``netem`` is missing from this kernel);
``lab`` builds the network namespaces, the bridge and the ``tc tbf`` rate limits, and starts
processes inside them.
"""
