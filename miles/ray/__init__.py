"""Miles' module paths for the classes its plug-ins subclass (`miles.ray.multi_lora.*`).

A backend or HTTP-server subclass written for Miles imports its base class from here and
loads unchanged with `--multi-lora-backend-path` / `--multi-lora-http-server-path`; the
classes themselves live in `miles.controller` (docs/MILES_COMPAT.md, "Plug-ins and
subclasses").
"""
