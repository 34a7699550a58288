"""Code the tests share: fakes, harnesses, data builders and waits, imported as `tests.helpers.<module>`.

A test module imports from here, never from another test module. Some files here also run
by path: `chromium.py` and `cookbook_venv.py` (`make test` prepares with them),
`cookbook_sl_entry.py` and `older_sdk_client.py` (run by other interpreters; they import
nothing from the project).
"""

from pathlib import Path

HELPERS_DIR = Path(__file__).resolve().parent
"""Where the helpers that run by path are."""
