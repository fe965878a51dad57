"""``onceonly dashboard``: a web page over a ledger, and the JSON API it reads (``onceonly.dashboard.app``).

Needs the ``dashboard`` extra (Starlette, uvicorn); ``onceonly.dashboard.app`` imports them.
"""
