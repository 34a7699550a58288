"""Miles' path of the HTTP server base class (`from miles.ray.multi_lora.http_server import MultiLoRAHTTPServer`)."""

from miles.controller.http_server import MultiLoRAHTTPServer

__all__ = ["MultiLoRAHTTPServer"]
