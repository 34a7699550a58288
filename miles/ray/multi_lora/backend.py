"""Miles' path of the backend base class (`from miles.ray.multi_lora.backend import MultiLoRABackend`)."""

from miles.controller.backend import BackendArgs, MultiLoRABackend

__all__ = ["BackendArgs", "MultiLoRABackend"]
