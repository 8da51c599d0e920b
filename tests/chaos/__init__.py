"""The chaos suite: scenarios of real processes with faults injected at exact rounds.

``scenario`` says what happens when, ``runner`` makes it happen against a local ``Cluster`` and
checks the invariants (``invariants``) after every closed round, ``results`` lists the faults and
recoveries and writes the results, ``table`` renders them.
Nothing is imported here, so ``python -m tests.chaos.table`` needs only the standard library.
"""
