"""The benchmarks behind ``sparseloco bench`` (reported numbers, never pass/fail).

- ``naive``: the codec baseline, written as one would first write it with plain torch ops;
- ``codec_bench``: payload size, encode and decode+aggregate speed, aggregation memory;
  ``codec_tables`` renders them as the README's tables;
- ``memory``: peak-RSS measurement of one aggregation in a fresh subprocess;
- ``quality``: SparseLoCo, DiLoCo and DDP side by side (JSON, a table and a plot);
- ``round_bench``: where the time of a networked round goes, phase by phase (runs ``up``).
"""
