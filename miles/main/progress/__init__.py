"""What the trainer shows a person while it runs, the metrics it records, and the table
it ends with.

- `metrics`: one loop record per trained batch and ONE adapter record per optimizer step,
  stepped on the adapter's step (the step's batches merged; a client-driven adapter's per
  `optim_step`), with its trained samples per second.
- `console`: on a terminal a live table redrawn each iteration, log lines scrolling above
  it; otherwise one log line per trained batch; at exit, per adapter, the reward and loss
  of the first and last steps, steps taken, and the latest checkpoint.
- `run`: `RunProgress`, which follows the driver's snapshots (steps are read from them),
  feeds both, hands trained batches to `--dump-details` and reports each adapter's latest
  step reward or loss to the controller (its Prometheus `/metrics`).
"""

from miles.main.progress.console import make_view
from miles.main.progress.run import RunProgress

__all__ = ["RunProgress", "make_view"]
