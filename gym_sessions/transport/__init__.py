"""What rests on uvicorn's own classes: the listeners' protocol, the worker server, the supervisor.

uvicorn's public API serves an app; gym-sessions needs more of it: request
heads bounded as they arrive and connections that can be handed to another
worker (`http_protocol`), replies written in one go (`coalesced_cycle`), the
private listeners (`private_listener`), and workers that drain and die with
their supervisor (`supervisor`, `parent_death`). Those subclass uvicorn's
protocol, server and multiprocess supervisor and read their attributes, which
uvicorn may change in any release: they are all here, tested against the
uvicorn versions in ``http_protocol.TESTED_UVICORN``. On any other version
handoff and coalesced replies turn themselves off (each worker that would hand
connections over logs one line) and the rest runs as before.
``make uvicorn-latest`` runs this package's tests against the newest uvicorn.

This package imports nothing of gym-sessions above its leaf modules: the
routing rule and the server build on it, never the reverse.
"""
