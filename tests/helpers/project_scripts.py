"""The project's scripts (`scripts/`, `scripts/bench/`) imported by file path, for tests of their functions.

    gpu_check = load_script("gpu_check.py")
    lora_nbytes = load_script("bench/trainer_service.py").lora_nbytes

Each call runs the file as a fresh module named after it (its stem), registered in
`sys.modules` under that name: a script's dataclasses look their module up there, and a
bench script that imports a sibling by name then gets the module the test holds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"


def load_script(relative_path: str) -> ModuleType:
    """The script at `scripts/<relative_path>`, run as the module `<its stem>`."""
    path = SCRIPTS_DIR / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, f"no script at {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
