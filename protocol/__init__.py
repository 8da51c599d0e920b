"""What crosses the wire: the codec, the payload envelope, fingerprints and errors.

Pure functions on tensors and bytes, no network I/O; imports neither ``node`` nor
``coordinator``.
"""
