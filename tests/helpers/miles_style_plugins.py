"""Control-plane plug-ins written as for Miles: imported from Miles' module paths, with
Miles' constructor signatures and its `async` hooks."""

from __future__ import annotations

from typing import Any

from miles.ray.multi_lora.backend import MultiLoRABackend
from miles.ray.multi_lora.http_server import MultiLoRAHTTPServer


class QuotaBackend(MultiLoRABackend):
    def __init__(self, args: Any, router_url: str) -> None:
        super().__init__(args, router_url)
        self.max_rank = args.lora_rank // 2  # Miles' flags by their names
        self.opened = False

    async def init(self) -> None:
        self.opened = True

    async def close(self) -> None:
        self.opened = False

    async def validate_adapter(self, name: str, config: Any) -> None:
        await super().validate_adapter(name, config)
        if config.rank > self.max_rank:
            raise ValueError(f"Adapter '{name}' rank {config.rank} exceeds the quota {self.max_rank}")


class QuotaServer(MultiLoRAHTTPServer):
    def __init__(self, backend: Any, host: str = "127.0.0.1", api_port: int = 0) -> None:
        super().__init__(backend, host, api_port)

    def add_routes(self, app: Any) -> None:
        super().add_routes(app)
        app.get("/quota")(self.quota)

    async def quota(self) -> dict[str, Any]:
        return {"max_rank": self.backend.max_rank, "opened": self.backend.opened}


class ThreeArgumentBackend(MultiLoRABackend):
    def __init__(self, args: Any, router_url: str, extra: int) -> None:
        super().__init__(args, router_url)
