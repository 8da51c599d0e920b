"""The coordinator service (issue 3): membership, round state machine, gather sets, manifests.

Empty for now; it will never import ``node`` (DESIGN.md layering rules).
"""
