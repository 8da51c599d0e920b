"""Helpers the tests share; none of them is a test itself.

Imported as ``support.<module>`` (pytest puts ``tests/`` on ``sys.path``):

- ``reference_codec``: the slow, obvious reference the codec is checked against.
- ``malformed_fixtures``: one valid payload and the helpers that corrupt it field by field.
- ``harness``: the coordinator as a real process, and its config file.
- ``cluster``: a local cluster of real processes (store, coordinator, nodes) for end-to-end runs.
- ``codec_inputs``: seeded tensors of awkward shapes and the hypothesis strategies for the codec.
- ``api``: the coordinator's HTTP API in-process (``make_api`` and the ``Api`` it returns).
- ``fake_coordinator``, ``fake_store``: in-memory fakes behind the node's coordinator and
  transfer seams, with a clock.
- ``daemon_harness``: real ``NodeDaemon``s wired to those fakes, for the daemon's unit tests.
- ``browser``: headless Chromium through selenium (the ``browser`` fixture), and reading a page.
- ``cutting_server``: a loopback object server that drops connections mid-body (resets).
- ``parts``: the multipart tests' run, node client, lowered part size and part-cutting session.
- ``wan_transfer``: a node process that sends and fetches one large payload (the WAN lab's).
"""
