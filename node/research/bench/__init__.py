"""Benchmarks of the codec against a straightforward torch baseline (``sparseloco bench codec``).

- ``naive``: the baseline, written as one would first write it with plain torch ops;
- ``memory``: peak-RSS measurement of one aggregation in a fresh subprocess;
- ``codec_bench``: payload size, throughput and memory reports, and their markdown tables.
"""
