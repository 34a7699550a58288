"""The Tinker protocol's gateway: the official `tinker` SDK talks to the trainer (DESIGN §11).

`ServiceClient(base_url=<control plane URL>, api_key=<its token>)` reaches routes under
`/api/v1` on the control plane's app (same process, port and token). A Tinker model is a
client-driven adapter in the same registry and slots as the RL adapters; each of its calls
is a command in a per-model log kept in the registry's SQLite file; the driver takes the
runnable commands through the controller actor and reports the results, which
`retrieve_future` hands back. The routes never call the trainer.

    wire.py         the JSON bodies we accept (pydantic, the SDK's field names)
    proto.py        the protobuf bodies (forward_backward in, its output out), read and written by hand
    command_log.py  futures, seq_id order, barriers, idempotent retries, durability (plain Python)
    gateway.py      the owners below composed over the command log, and the calls that span them
                    (create and unload a model, submit a command, the driver's side; no HTTP)
    sessions.py     sessions, their heartbeats and expiry, kept in SQLite
    models.py       models as client-driven adapters: layout checks, registration, unload
    paging.py       idle models paged out of their slots, and back in on their next command
    sampling_sessions.py  sampling sessions and the sampler snapshots they name
    saves.py        the save and load commands' targets (names, paths, directories)
    checkpoint_rules.py  lookups, deletions and TTLs of written checkpoints, sparing those still needed
    checkpoints.py  the written checkpoints' records (SQLite) and their signed file downloads
    errors.py       the gateway's refusals, one class per HTTP status
    sampler.py      sample / compute_logprobs of a snapshot or the base model through the router (HTTP)
    sampling.py     sample futures: asyncio tasks on the controller's loop, read by retrieve_future
    sample_wire.py  the SDK's sample request in, its SampleResponse out (JSON or protobuf)
    routes.py       the FastAPI routes and the retrieve_future answers

docs/TINKER_COMPAT.md lists each route and SDK call with its status and its test.
"""
