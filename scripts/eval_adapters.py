"""Held-out greedy accuracy of the base model and of each trained adapter, on every task.

    python scripts/eval_adapters.py --config configs/tiny-multi-lora.yaml [--n 300]
    python scripts/eval_adapters.py --config configs/smollm2-multi-lora.yaml --recipe smollm2 --n 100 --own-tasks

Reads the run config (the same YAML the trainer ran with), finds each adapter's latest
checkpoint under its save directory, and evaluates base and adapters on each adapter's
held-out split (the adapter's `data` path with `_train` replaced by `_test`). Prints a
matrix: one row per model, one column per task; `*` marks an adapter's own task.
`--json FILE` also writes it, with each adapter's steps, for `scripts/results_table.py`.
`--recipe` picks how a task is scored: `tiny` (text prompts of `miles.recipes.tasks`,
numeric answer on the first line) or `smollm2` (chat prompts of `miles.recipes.smollm2`,
the whole reply must be the bare answer).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.backends.common.checkpoint import latest_checkpoint
from miles.recipes import smollm2, tasks
from miles.utils.adapter_config import AdapterDefaults, parse_adapter_run_yaml, resolve_adapter_config
from miles.utils.arguments import parse_args

EVALUATORS = {"tiny": tasks.evaluate_adapter_dir, "smollm2": smollm2.evaluate_adapter_dir}


@dataclass(frozen=True)
class EvalTarget:
    adapter: str
    test_data: Path
    checkpoint: Path | None


def held_out_path(train_path: str | Path) -> Path:
    path = Path(train_path)
    test = path.with_name(path.name.replace("_train", "_test"))
    if test == path or not test.exists():
        raise FileNotFoundError(f"no held-out split next to {path} (expected a '_test' twin)")
    return test


def eval_targets(config_path: str) -> tuple[str, list[EvalTarget]]:
    cfg = parse_args(["--config", config_path])
    defaults = AdapterDefaults.from_config(cfg)
    targets = []
    for name, yaml_path in cfg.initial_adapters:
        adapter = resolve_adapter_config(name, parse_adapter_run_yaml(yaml_path, name=name), defaults)
        targets.append(EvalTarget(name, held_out_path(adapter.data), latest_checkpoint(adapter.save)))
    return cfg.hf_checkpoint, targets


def accuracy_matrix(base_dir: str, targets: list[EvalTarget], n: int | None,
                    recipe: str = "tiny", own_tasks: bool = False) -> dict[str, dict[str, float]]:
    """model ('base' or adapter) -> task (adapter name) -> accuracy; with `own_tasks`
    an adapter is scored on its own task only (the base on every task)."""
    evaluate_adapter_dir = EVALUATORS[recipe]
    models: dict[str, Path | None] = {"base": None}
    models.update({t.adapter: t.checkpoint for t in targets if t.checkpoint is not None})
    return {
        model: {t.adapter: evaluate_adapter_dir(base_dir, ckpt, t.test_data, n) for t in targets
                if not own_tasks or model in ("base", t.adapter)}
        for model, ckpt in models.items()
    }


def format_matrix(matrix: dict[str, dict[str, float]]) -> str:
    tasks = list(dict.fromkeys(task for accs in matrix.values() for task in accs))
    header = ["model", *tasks]
    rows = [[model, *("-" if task not in accs else f"{accs[task]:.1%}{'*' if model == task else ''}" for task in tasks)]
            for model, accs in matrix.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--n", type=int, default=None, help="rows of each held-out split (default: all)")
    parser.add_argument("--recipe", choices=sorted(EVALUATORS), default="tiny",
                        help="how tasks are prompted and scored")
    parser.add_argument("--own-tasks", action="store_true", help="score each adapter on its own task only (faster)")
    parser.add_argument("--json", type=Path, default=None, help="also write the accuracies and steps to this file")
    args = parser.parse_args(argv)
    base_dir, targets = eval_targets(args.config)
    missing = [t.adapter for t in targets if t.checkpoint is None]
    if missing:
        print(f"no checkpoint yet for: {', '.join(missing)} (train first)", file=sys.stderr)
    matrix = accuracy_matrix(base_dir, targets, args.n, args.recipe, args.own_tasks)
    print("\nHeld-out greedy accuracy (* = the adapter's own task)")
    print(format_matrix(matrix), flush=True)
    if args.json is not None:
        steps = {t.adapter: int(t.checkpoint.name.removeprefix("step_")) for t in targets if t.checkpoint is not None}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": args.config, "n": args.n, "accuracy": matrix, "steps": steps},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
