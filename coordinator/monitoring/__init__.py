"""What the run looks like from outside: views and series built from the database.

May import ``base``, ``state`` and ``rules``.

    status.py        the run's status view for dashboards (reads only)
    metrics.py       Prometheus metrics; the run's counters start from the database's totals
    node_metrics.py  each node's series (losses, timings, rates, bytes, retries) from its reports
"""
