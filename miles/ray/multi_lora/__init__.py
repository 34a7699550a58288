"""Miles' `miles.ray.multi_lora` package: the base classes of its control-plane plug-ins."""
