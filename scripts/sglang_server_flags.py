"""Refresh the saved list of SGLang's server flags from a real SGLang install.

    make gpu-check        # installs SGLang (0.5.23) in .venv-sglang, among its checks
    .venv-sglang/bin/python scripts/sglang_server_flags.py \
        --out tests/rollout/engines/sglang_0_5_23_server_flags.json

The list is the source of truth for the SGLang command line on every machine, SGLang or
not: `tests/rollout/engines/test_server_command.py` (and `tests/scripts/test_gpu_check.py`)
parse every command the trainer builds with a parser made from it. Run this script with
the interpreter SGLang is installed in (it imports only the standard library and
`sglang`, not miles); with another SGLang release, write a file named after that version
and point `SGLANG_FLAGS` in test_server_command.py at it.

Each long option of `argparse.ArgumentParser()` after `ServerArgs.add_cli_args` (aliases
too, `--help` included) becomes one line: its arity (`nargs`, 0 for a switch, 1 for one
value), its choices, and its type (`int`, `float`, `str`, or null for any other converter).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SOURCE = ("every option of argparse.ArgumentParser() after sglang.srt.server_args.ServerArgs.add_cli_args "
          "(sglang {version} wheel); nargs 0 = a switch")
TYPES = {int: "int", float: "float", str: "str"}


def describe(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """flag -> {"nargs", "choices", "type"} for every long option of `parser`."""
    flags = {}
    for action in parser._actions:
        nargs = 1 if action.nargs is None else action.nargs
        entry = {"nargs": nargs, "choices": None if action.choices is None else list(action.choices),
                 "type": TYPES.get(action.type)}
        for flag in action.option_strings:
            if flag.startswith("--"):
                flags[flag] = entry
    return dict(sorted(flags.items()))


def render(version: str, flags: dict[str, dict[str, Any]]) -> str:
    """The file's text: one flag per line, so that a refresh diffs flag by flag."""
    lines = [json.dumps(flag) + ": " + json.dumps(entry, separators=(",", ":")) for flag, entry in flags.items()]
    return ("{\n"
            f"\"sglang_version\": {json.dumps(version)},\n"
            f"\"source\": {json.dumps(SOURCE.format(version=version))},\n"
            "\"flags\": {\n" + ",\n".join(lines) + "\n}\n}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="The file to write (default: standard output).")
    args = parser.parse_args(argv)
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        print(f"sglang does not import under {sys.executable} ({exc}); run this with the interpreter of the "
              "environment SGLang is installed in, e.g. .venv-sglang/bin/python", file=sys.stderr)
        return 2
    server = argparse.ArgumentParser()
    ServerArgs.add_cli_args(server)
    text = render(sglang.__version__, describe(server))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {len(describe(server))} flags of sglang {sglang.__version__} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
