"""`miles-lora`: the command-line client of the control plane.

    miles-lora list                                   # every adapter: state, slot, step
    miles-lora get math                               # one adapter's run and config
    miles-lora register math --yaml configs/adapters/math.yaml
    miles-lora register math --set data=data/math.jsonl --set num_step=20 --set rm_type=math
    miles-lora register late --yaml late.yaml --priority 5   # every slot held: QUEUED, ahead of lower priorities
    miles-lora retire math                            # finish the step, save, free the slot (QUEUED: leave the queue)
    miles-lora watch --interval 2                     # a live table until Ctrl-C
    miles-lora list --json                            # machine-readable output (or miles-lora --json list)

`--url` (env `MILES_LORA_URL`, default http://127.0.0.1:8068) names the control plane:
the trainer's (`python -m miles.main.train_multi_lora_async`) or the standalone one
(`python -m miles.main.control_plane`); `--token` (env `MILES_API_TOKEN`) is its bearer token.
`--set` values are read as YAML scalars, so `num_step=20` is a number and
`metadata={rm_type: math}` a mapping. `--yaml FILE` is read by the control plane itself
(the path must be on its machine and inside its allowed roots).

Exit codes: 0 success, 1 the control plane refused the request (its message is shown),
2 a usage error, 3 the control plane cannot be reached, 4 no adapter of that name.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml

from miles.controller.client import ControlPlaneClient, ControlPlaneError
from miles.utils.types import AdapterStatus

DEFAULT_URL = "http://127.0.0.1:8068"
EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNKNOWN_ADAPTER = 1, 2, 3, 4

app = typer.Typer(help="Manage the LoRA adapters of a running multi-LoRA trainer.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


class _Options:
    url: str = DEFAULT_URL
    token: str | None = None
    json: bool = False


OPTIONS = _Options()


@app.callback()
def _global(
    url: Annotated[str, typer.Option(envvar="MILES_LORA_URL", help="Control-plane URL.")] = DEFAULT_URL,
    token: Annotated[str | None, typer.Option(envvar="MILES_API_TOKEN", show_envvar=True,
                                                 help="Bearer token of the control plane.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    OPTIONS.url, OPTIONS.token, OPTIONS.json = url, token, as_json


JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text (as the global --json).")]
"""Each command takes `--json` after its name too: `miles-lora list --json` = `miles-lora --json list`."""


def _json_output(as_json: bool) -> bool:
    OPTIONS.json = OPTIONS.json or as_json
    return OPTIONS.json


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _call(action: str, fn: Any, *args: Any, adapter: str | None = None, **kwargs: Any) -> Any:
    """Run one client call; every failure becomes a message on stderr and an exit code."""
    try:
        with ControlPlaneClient(OPTIONS.url, token=OPTIONS.token) as client:
            return fn(client, *args, **kwargs)
    except ControlPlaneError as exc:
        if exc.status_code == 404 and adapter is not None:
            _fail(f"no adapter named '{adapter}' ({exc.detail})", EXIT_UNKNOWN_ADAPTER)
        if exc.status_code == 401:
            _fail(f"{action}: unauthorized ({exc.detail}); pass --token or set MILES_API_TOKEN", EXIT_REFUSED)
        _fail(f"{action}: HTTP {exc.status_code}: {exc.detail}", EXIT_REFUSED)
    except httpx.TransportError as exc:
        _fail(f"cannot reach the control plane at {OPTIONS.url} ({type(exc).__name__}: {exc}); is the trainer "
              "or `python -m miles.main.control_plane` running? Set --url or MILES_LORA_URL", EXIT_UNREACHABLE)


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=None if isinstance(value, list) else 2, sort_keys=False))


def _progress(status: AdapterStatus) -> str:
    return f"{status.step}/{status.num_step}" if status.num_step is not None else str(status.step)


COLUMNS = ("NAME", "STATE", "SLOT", "VERSION", "STEP", "RANK", "DATA")


def _source(status: AdapterStatus) -> str:
    """What trains it: its dataset, or the Tinker model id of a client-driven adapter."""
    return status.data if status.data is not None else f"(client) {status.model_id}"


def _state(status: AdapterStatus) -> str:
    """The state, with its place in the queue when QUEUED (`QUEUED #1`: the next slot is its)."""
    if status.queue_position is None:
        return status.state.value
    return f"{status.state.value} #{status.queue_position}"


def _rows(statuses: list[AdapterStatus]) -> list[tuple[str, ...]]:
    return [(s.name, _state(s), "-" if s.slot is None else str(s.slot), "-" if s.version is None else str(s.version),
             _progress(s), str(s.rank), _source(s)) for s in statuses]


ERROR_LINE_CHARS = 160
"""A failed adapter's error under the table is cut to this (`get NAME` shows all of it)."""


def _table(statuses: list[AdapterStatus]) -> str:
    """The table, then one line per adapter that failed: why (its `last_error`)."""
    rows = [COLUMNS, *_rows(statuses)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for status in statuses:
        if status.last_error is not None:
            why = status.last_error.summary()
            cut = why if len(why) <= ERROR_LINE_CHARS else why[:ERROR_LINE_CHARS - 1] + "\u2026"
            lines.append(f"{status.name} failed: {cut}")
    return "\n".join(lines)


@app.command("list")
def list_adapters(as_json: JsonFlag = False) -> None:
    """Every adapter the control plane knows: live ones by slot, then finished ones (and why each
    FAILED one failed)."""
    statuses = _call("list adapters", lambda c: c.list())
    if _json_output(as_json):
        _print_json([s.model_dump(mode="json") for s in statuses])
    elif not statuses:
        typer.echo("No adapters registered.")
    else:
        typer.echo(_table(statuses))


@app.command("get")
def get_adapter(name: Annotated[str, typer.Argument(help="Adapter name.")], as_json: JsonFlag = False) -> None:
    """One adapter's state, step and resolved config."""
    status = _call(f"get '{name}'", lambda c: c.status(name), adapter=name)
    if _json_output(as_json):
        _print_json(status.model_dump(mode="json"))
        return
    for key, value in status.model_dump(mode="json").items():
        typer.echo(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs to config fields, each value read as YAML (numbers, booleans, mappings).

    >>> parse_set(["data=d.jsonl", "num_step=20", "lr=1e-4", "metadata={rm_type: math}"])
    {'data': 'd.jsonl', 'num_step': 20, 'lr': 0.0001, 'metadata': {'rm_type': 'math'}}
    """
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {pair!r}: expected key=value, e.g. --set num_step=20")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {pair!r}: the value is not valid YAML "
                             f"({getattr(exc, 'problem', None) or exc})") from None
        if isinstance(value, float) or (isinstance(value, str) and _looks_like_float(raw)):
            value = float(raw)  # YAML 1.1 reads "1e-4" as a string
        config[key.strip()] = value
    return config


def _looks_like_float(raw: str) -> bool:
    return _EXPONENT_FLOAT.fullmatch(raw.strip()) is not None


_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


@app.command("register")
def register(
    name: Annotated[str, typer.Argument(help="Adapter name (letters, digits, '.', '_', '-').")],
    yaml_file: Annotated[Path | None, typer.Option("--yaml", help="Adapter YAML, read by the control plane.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="A config field as key=value (repeatable).")] = None,
    priority: Annotated[int | None, typer.Option(
        help="Place in the queue when every slot is held: higher leaves first, ties in arrival order.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Register an adapter from a YAML file or from --set fields; prints its slot, or its place in
    the queue when every slot is held."""
    if (yaml_file is None) == (not set_):
        _fail("give exactly one of --yaml FILE or --set key=value ...", EXIT_USAGE)
    try:
        config = parse_set(set_) if set_ else None
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    yaml_path = str(yaml_file.expanduser().resolve()) if yaml_file is not None else None
    answer = _call(f"register '{name}'",
                   lambda c: c.register_adapter(name, config=config, yaml_path=yaml_path, priority=priority))
    if _json_output(as_json):
        _print_json(answer.model_dump(mode="json"))
    elif answer.slot is None:
        typer.echo(f"Queued '{name}' at position {answer.queue_position}: every slot is held. It takes the next "
                   "free slot in priority, then arrival, order (`miles-lora get` shows its place; `retire` "
                   "takes it out of the queue).")
    else:
        typer.echo(f"Registered '{name}' in slot {answer.slot} (PENDING until its weights reach the engines).")


@app.command("retire")
def retire(name: Annotated[str, typer.Argument(help="Adapter name.")], as_json: JsonFlag = False) -> None:
    """Retire an adapter: it finishes its current step, saves, and frees its slot. A QUEUED one is
    taken out of the queue (and forgotten: it never held a slot)."""
    state = _call(f"retire '{name}'", lambda c: c.deregister(name), adapter=name)
    if _json_output(as_json):
        _print_json({"name": name, "status": "retiring" if state is not None else "removed from the queue"})
    elif state is None:
        typer.echo(f"Removed '{name}' from the queue: it never held a slot, so nothing was trained or saved.")
    else:
        typer.echo(f"Retiring '{name}': it finishes its current step, saves, and frees its slot.")


@app.command("watch")
def watch(
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between refreshes.")] = 2.0,
    count: Annotated[int | None, typer.Option(min=1, help="Stop after this many refreshes.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Refresh the adapter table until Ctrl-C (with --json: one JSON line per refresh)."""
    live = not _json_output(as_json) and sys.stdout.isatty()
    n = 0
    try:
        while count is None or n < count:
            statuses = _call("watch", lambda c: c.list())
            n += 1
            if OPTIONS.json:
                typer.echo(json.dumps({"time": time.time(), "adapters": [s.model_dump(mode="json") for s in statuses]}))
            else:
                header = f"{time.strftime('%H:%M:%S')}  {OPTIONS.url}  ({len(statuses)} adapters)"
                if live:
                    typer.echo("\033[2J\033[H", nl=False)  # clear the screen, cursor home
                typer.echo(f"{header}\n{_table(statuses)}\n")
            if count is None or n < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def main() -> None:
    app(prog_name="miles-lora")


if __name__ == "__main__":
    main()
