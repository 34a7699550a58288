"""Property-based fuzzing of the control plane from its own OpenAPI schema (schemathesis).

Every operation is called in-process (ASGI) with generated valid and invalid inputs,
with the token; none may answer 5xx. Two adapters are registered first, and generated
registrations point at a real small dataset half of the time. Bounded to
a few seconds per operation so it runs in CI.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from miles.controller.backend import MultiLoRABackend
from miles.controller.http_server import HTTPServerConfig, MultiLoRAHTTPServer
from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import ROLLOUT_HOOKS

TOKEN = "fuzz-token"
FUZZED = ("POST /adapter_runs", "GET /adapter_runs/state", "GET /adapter_runs/{name}", "DELETE /adapter_runs/{name}")
"""The operations that take input; the others are called once per generation mode."""


async def test_no_operation_answers_5xx(data_root: Path, defaults: AdapterDefaults) -> None:
    backend = MultiLoRABackend(4, defaults, hooks=ROLLOUT_HOOKS)
    dataset = str(data_root / "data" / "train.jsonl")
    for name in ("a", "b"):  # reads and deletes also meet adapters that exist
        await backend.register(name, config={"data": dataset})
    server = MultiLoRAHTTPServer(backend, config=HTTPServerConfig(token=TOKEN, allowed_roots=(data_root.resolve(),)))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    schema = schemathesis.openapi.from_asgi("/openapi.json", server.app, headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"GET /health", "POST /adapter_runs", "DELETE /adapter_runs/{name}"}
    calls: dict[str, list[int]] = {}

    for operation, mode in itertools.product(operations, GenerationMode):
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def no_5xx(case) -> None:
            config = case.body.get("config") if isinstance(case.body, dict) else None
            if isinstance(config, dict) and len(str(case.body)) % 2:  # some registrations can succeed
                config["data"] = dataset
            response = case.call(headers=auth)
            calls.setdefault(operation.label, []).append(response.status_code)
            assert response.status_code < 500, (operation.label, mode, case.body, response.text[:500])

        try:
            no_5xx()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing in its schema can be made invalid (any string is)

    assert all(len(calls[label]) >= 20 for label in FUZZED), {k: len(v) for k, v in calls.items()}
    assert any(400 <= code < 500 for code in calls["POST /adapter_runs"])
