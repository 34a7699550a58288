"""A small synchronous client of the control-plane HTTP API, for users, tests and the demo.

    with ControlPlaneClient("http://127.0.0.1:8068", token=os.environ.get("MILES_API_TOKEN")) as cp:
        cp.register("math", config={"data": "data/math.jsonl", "num_step": 20})  # its slot (None: QUEUED)
        cp.wait_for_state("math", AdapterState.ACTIVE, timeout=60)
        print(cp.status("math").step)
        cp.deregister("math")

Every non-2xx answer raises `ControlPlaneError` carrying the status code and the
server's `detail`.
"""

from __future__ import annotations

import builtins
import time
from typing import Any

import httpx

from miles.utils.types import AdapterState, AdapterStatus, RegisterAdapterResponse


class ControlPlaneError(RuntimeError):
    """The control plane refused a request."""

    def __init__(self, status_code: int, detail: Any, method: str, path: str) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"{method} {path} -> HTTP {status_code}: {detail}")


class ControlPlaneClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Loopback and cluster addresses must never go through an environment proxy.
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, trust_env=False)

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ControlPlaneError(response.status_code, detail, method, path)
        return response.json()

    def health(self) -> bool:
        return self._request("GET", "/health") == {"status": "healthy"}

    def register(self, name: str, config: dict[str, Any] | None = None, yaml_path: str | None = None,
                 priority: int | None = None) -> int | None:
        """Register an adapter from inline fields or a YAML path; returns its slot, or None when
        every slot is held and it was QUEUED (`priority`: higher ones leave the queue first)."""
        return self.register_adapter(name, config, yaml_path, priority).slot

    def register_adapter(self, name: str, config: dict[str, Any] | None = None, yaml_path: str | None = None,
                         priority: int | None = None) -> RegisterAdapterResponse:
        """`register`, with the whole answer: its state (PENDING or QUEUED) and queue position."""
        body: dict[str, Any] = {"name": name}
        if config is not None:
            body["config"] = config
        if yaml_path is not None:
            body["yaml_path"] = str(yaml_path)
        if priority is not None:
            body["priority"] = priority
        return RegisterAdapterResponse.model_validate(self._request("POST", "/adapter_runs", json=body))

    def deregister(self, name: str) -> AdapterState | None:
        """PENDING/ACTIVE -> RETIRING; returns the state after, None when it was QUEUED (removed
        from the queue and forgotten)."""
        state = self._request("DELETE", f"/adapter_runs/{name}").get("state")
        return None if state is None else AdapterState(state)

    def status(self, name: str) -> AdapterStatus:
        return AdapterStatus.model_validate(self._request("GET", f"/adapter_runs/{name}"))

    def list(self, page_size: int = 1000) -> builtins.list[AdapterStatus]:
        """Every adapter, read a page of `page_size` (at most 1,000) at a time."""
        statuses: builtins.list[AdapterStatus] = []
        offset: int | None = 0
        while offset is not None:
            page = self._request("GET", "/adapter_runs", params={"limit": page_size, "offset": offset})
            statuses += [AdapterStatus.model_validate(a) for a in page["adapters"]]
            offset = page["next_offset"]
        return statuses

    def states(self, names: builtins.list[str]) -> dict[str, AdapterState | None]:
        raw = self._request("GET", "/adapter_runs/state", params={"names": list(names)})["states"]
        return {n: (AdapterState(s) if s is not None else None) for n, s in raw.items()}

    def metrics(self) -> str:
        response = self._http.get("/metrics")
        if response.status_code >= 400:
            raise ControlPlaneError(response.status_code, response.text, "GET", "/metrics")
        return response.text

    def wait_for_state(self, name: str, state: AdapterState | str, timeout: float = 60.0,
                       poll_s: float = 0.1) -> AdapterState:
        """Poll until `name` is in `state`; TimeoutError names the last state seen."""
        target = AdapterState(state)
        deadline = time.monotonic() + timeout
        last = None
        while True:
            last = self.states([name])[name]
            if last is target:
                return last
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Adapter '{name}' not {target.value} after {timeout}s (last state: {last})")
            time.sleep(poll_s)
