"""A node's compute: the model, its data, inner AdamW and the SparseLoCo outer step.

Plain synchronous code on tensors, free of network I/O, so every piece is tested without a socket:
``model`` (the decoder-only transformer and its presets), ``data`` (corpus loading, the held-out
split, deterministic per-worker batches), ``optim`` (AdamW with the global-step schedule),
``outer`` (error feedback, compression, deterministic sparse aggregation, apply, add-back),
``share`` (one participant's θ, error buffer, AdamW and data), ``worker`` (a round's steps on
it) and ``state`` (the atomic on-disk state a restart continues from; ``stateread`` reads it
back). The daemon and the simulator both build on these.
"""
