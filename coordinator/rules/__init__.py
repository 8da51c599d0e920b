"""The round rules and the state machine that applies them to the database (no HTTP, no store).

May import ``base`` and ``state``.

    rounds.py       the round rules as pure functions (round in progress, expected and
                    waited-for sets, gather policy, deadlines learnt from honest arrivals)
    membership.py   members: join, heartbeat, leave, timeouts, revocation, the end of the run,
                    last heartbeat times, the process each active member is bound to
    deadlines.py    when a deadline closes a round: held, gathering, paused while the store is down
    budget.py       a round's time budget: the median member's time for a whole round, learnt
    progress.py     the open round's submitters and missing members in memory (the close check)
    votes.py        the nodes' reports of closed rounds: only a round's participants vote
    machine.py      the round state machine over the database (synchronous, injected clock)
    submissions.py  who may submit to which round, the answer to a retry, a submission's verdict
    payloadchecks.py  the open round's grants, and submissions answered before their object
                    was confirmed (a close waits for them)
    closing.py      what opening and closing a round do: decide, sign, store, start the next
    tokens.py       node tokens: sha256 digests in the database, seeding rule, checked on every
                    request, reloaded when the operator changes them
    checkpoints.py  who uploads θ_R as a checkpoint (members only), and when it is committed
"""
