"""SGLang 0.5.23's server flags as data, for checking the commands the project builds for it.

    args, unknown = parser_from_flag_list().parse_known_args(argv[3:])  # after `python -m sglang.launch_server`
    check_lora_limits("versioned", args, n_slots=4)

The flags live in `tests/rollout/engines/sglang_0_5_23_server_flags.json` (its test says
how to refresh it from a real SGLang install).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SGLANG_FLAGS = Path(__file__).resolve().parents[1] / "rollout" / "engines" / "sglang_0_5_23_server_flags.json"
"""What SGLang 0.5.23's own argument parser defines, with the version it came from."""


def parser_from_flag_list() -> argparse.ArgumentParser:
    """An argparse parser with exactly the options (arity, choices, types) SGLang 0.5.23 defines."""
    spec = json.loads(SGLANG_FLAGS.read_text())
    assert spec["sglang_version"].startswith("0.5.")
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, exit_on_error=False)
    types = {"int": int, "float": float, "str": str, None: None}
    for flag, meta in spec["flags"].items():
        if meta["nargs"] == 0:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, nargs=None if meta["nargs"] == 1 else meta["nargs"], choices=meta["choices"],
                                type=types[meta["type"]])
    return parser


def check_lora_limits(mode: str, args: argparse.Namespace, n_slots: int) -> None:
    """SGLang's own checks (max_loaded_loras >= max_loras_per_batch > 0) plus ours: room for every name."""
    assert args.max_loras_per_batch > 0 and args.max_loaded_loras >= args.max_loras_per_batch
    names = n_slots * (2 if mode == "versioned" else 1)
    assert args.max_loaded_loras >= names + 1 and args.max_loras_per_batch >= names + 1  # + the base model
    assert args.tokenizer_worker_num == 1
    assert args.enable_lora and args.max_lora_rank > 0
