"""The multi-LoRA control plane: adapter lifecycle registry, backend, HTTP API, Ray actor.

`registry.py` is the pure state machine, `backend.py` adds config resolution, validation
and request aborts, `http_server.py` serves the API, `actor.py` wraps both in the named
Ray actor, `client.py` is a small HTTP client. `python -m miles.controller` serves the
control plane without a trainer.
"""
