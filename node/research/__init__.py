"""Tools for studying the algorithm rather than running it over the network.

``simulate`` trains N workers of SparseLoCo, DiLoCo or AdamW DDP in one process on equal token
budgets (``sparseloco simulate``); ``progress`` shows long jobs as a bar or as log lines;
``report`` prints a command's table and writes its JSON; ``bench`` holds the benchmarks behind
``sparseloco bench``: codec size, speed and memory against a straightforward torch baseline,
training quality, and where a networked round's time goes.
"""
