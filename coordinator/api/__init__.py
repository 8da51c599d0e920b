"""The HTTP service: what every handler shares, the handlers, and the app that wires them.

May import every room but ``ops``.

    service.py   the ``Coordinator`` every handler shares, and what follows a round's close
    wakeups.py   long-polls woken a batch per turn of the event loop (a close wakes ~N)
    handling.py  what every route shares: auth, body validation, query checks, error mapping
    uploads.py   upload grants (one PUT, or a URL per part) and completing an upload
    handlers.py  the aiohttp route handlers, by endpoint name
    confirm.py   a round's submissions confirmed by one listing before it closes
    openapi.py   the OpenAPI document generated from ``protocol.routes``
    app.py       ``create_app``: wiring, route registration, background tasks' lifecycle
    dashboard/   the page at ``/``: three static files shipped as package data
"""
