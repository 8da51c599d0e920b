"""Running the coordinator: the process, its checks, and the operator's commands.

The top room: it may import every other one, and none imports it (``coordinator.__main__``
dispatches here).

    preflight.py   checks before anything is written: the port, the object store, its promises
    storecheck.py  ``sparseloco store check``: what a store keeps of the project's promises
    server.py      running as a process: check, listen, announce, stop cleanly on a signal
    admin.py       ``coordinator token add|list|revoke``: the operator's token commands
    invite.py      what an invite needs besides the token: the public URL, the key fingerprint
    backup_cli.py  ``coordinator backup|restore``: the state directory to one file and back
"""
