"""The multi-LoRA control plane: adapter lifecycle registry, backend, HTTP API, Ray actor.

`registry.py` is the pure state machine, `store.py` keeps it in SQLite, `backend.py` adds
config resolution, validation, request aborts and the write-through to the store,
`http_server.py` serves the API, `actor.py` wraps both in the named Ray actor (restarted
by Ray if it dies), `client.py` is a small HTTP client. `python -m miles.main.control_plane`
serves the control plane without a trainer. `tinker/` is the Tinker protocol's gateway on
the same app: client-driven adapters and their command log.
"""
