"""Inference engines speaking SGLang's HTTP API, and the sglang-router in front of them.

    builtin_server.py   `python -m miles.rollout.engines.builtin_server ...`: the HTTP app
    builtin_engine.py   model + LoRA slot table + request validation behind that app
    scheduler.py        continuous-batching decode loop (one batched forward per step)
    sampling.py         logprobs, greedy, temperature, top-k, top-p
    lora_table.py       LoRA name -> page-table slot of the builtin engine (LRU order)
    server_command.py   command lines of the builtin engine and `sglang.launch_server`
    process.py          child server processes: launch, wait for health, stop
    engine_actor.py     `EngineActor`: one server per Ray actor, LoRA pushes into it, restarts
    router.py           launch `sglang_router.launch_router`, or attach to a running one
    fleet.py            `EngineFleet`: the engines and the router started and stopped as one

Pushes by broadcast use `miles.lora.weight_sync` on both ends (the sender joins at
rank 0; the builtin engine joins at its rank offset, as SGLang does).

Submodules are imported where they are used (the server process needs no Ray).
"""
