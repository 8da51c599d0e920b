"""``sparseloco up``: a whole networked run on one machine, every part a real process.

``seaweed`` runs the embedded S3-compatible store (SeaweedFS ``weed mini``) on loopback;
``process`` is the one supervisor of child processes (log file, SIGTERM then SIGKILL);
``launch`` writes the coordinator config and starts the coordinator and a node; ``up`` starts the
store, the coordinator and N nodes, and watches the run through the coordinator's status
(``status``); ``view`` renders the live table and the summary. The
integration tests and the chaos suite build their clusters from the same pieces.
"""
