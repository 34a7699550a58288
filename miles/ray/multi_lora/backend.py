"""Miles' path of the backend base class (`from miles.ray.multi_lora.backend import MultiLoRABackend`),
in Miles' form: a subclass's `__init__(self, args, router_url)` calls `super().__init__(args, router_url)`."""

from __future__ import annotations

from miles.controller import backend
from miles.controller.backend import BackendArgs


class MultiLoRABackend(backend.MultiLoRABackend):
    """`miles.controller.backend.MultiLoRABackend` built as Miles builds it, `cls(args, router_url)`;
    `self.args` holds `args`."""

    def __init__(self, args: BackendArgs, router_url: str | None) -> None:
        super().__init__(**args.backend_kwargs(router_url))
        self.args = args

    @classmethod
    def from_miles_args(cls, args: BackendArgs, router_url: str | None) -> MultiLoRABackend:
        return cls(args, router_url)


__all__ = ["BackendArgs", "MultiLoRABackend"]
