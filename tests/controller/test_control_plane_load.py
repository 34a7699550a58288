"""A small run of the control-plane load script: no 5xx, invariants (the queue's included)
hold afterwards, and no registration is refused for want of a slot.

The full size (2,000 requests at concurrency 32) is `scripts/bench/control_plane_load.py`
with its defaults; this runs 200 at concurrency 16. Latency is not checked here (the
machine is shared); the script reports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_small_load_run_has_no_5xx_and_keeps_invariants(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "control_plane_load.py"), "--requests", "200",
                    "--concurrency", "16", "--slots", "4", "--json", str(out)], check=True, cwd=ROOT, timeout=300)
    result = json.loads(out.read_text())
    assert result["server_errors"] == 0 and result["invariant_problems"] == []
    assert sum(row["n"] for row in result["by_kind"].values()) == 200
    statuses = result["statuses"]
    assert statuses.get("register 200", 0) >= 4 and statuses.get("delete 200", 0) >= 1  # slots churned
    assert result["trainer_iterations"] > 0 and result["accepted_registrations"] == statuses["register 200"]
    # With the registration queue on (the default), a full table queues instead of answering 409.
    assert "register 409" not in statuses and 0 <= result["queued_registrations"] <= statuses["register 200"]
