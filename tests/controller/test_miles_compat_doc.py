"""docs/MILES_COMPAT.md is true where it says "same": every flag it calls the same parses
here with the value it names (or the example's), and every route it calls the same answers
on a running control plane."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import httpx

from miles.utils.adapter_config import AdapterDefaults
from miles.utils.arguments import build_parser, parse_args
from tests.helpers.controller_fakes import ThreadedController, controller_config
from tests.helpers.miles_multi_lora_flags import BOUNDED_ARGV, WANDB_ARGV, split_flags

DOC = Path(__file__).resolve().parents[2] / "docs" / "MILES_COMPAT.md"
BASE_ARGV = ["--multi-lora-n-adapters", "4"]
VALUES = {
    "--custom-rm-path": ["miles.recipes.tasks.digit_match_reward"],
    "--reward-key": ["score"],
    "--rm-url": ["http://127.0.0.1:8000/reward"],
    "--kl-loss-coef": ["0.01"],
    "--kl-loss-type": ["k1"],
    "--multi-lora-adapter": ["gsm8k", "adapters/gsm8k.yaml"],
}
"""Values for the flags the doc names without one and the example does not pass."""


def same_rows(section: str) -> list[list[str]]:
    """The cells of each table row of `section` whose status cell says "same"."""
    text = DOC.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start:end if end != -1 else None].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 3 and cells[-1].lower().startswith("same"):
            rows.append(cells)
    return rows


def documented_flags() -> list[list[list[str]]]:
    """For each "same" row of the flag, loss and reward tables, its flags as `[--flag, value...]`
    (a row's flags go together on one command line, as the row names them). A flag shown with
    its default in parentheses, `` `--kl-loss-coef` (0) ``, takes that value; one shown "(off)"
    is left out (the row is about not giving it)."""
    example = {piece[0]: piece for piece in split_flags(BOUNDED_ARGV + WANDB_ARGV)}
    rows = []
    for section in ("Command-line flags of the multi-LoRA example", "Loss and advantage settings", "Rewards"):
        for cells in same_rows(section):
            flags = []
            for code, default in re.findall(r"`(--[a-z0-9-]+(?: [^`]*)?)`(?: \(([^)]*)\))?", cells[0]):
                if default == "off":
                    continue
                tokens = shlex.split(code) + ([default] if default and " " not in code else [])
                if tokens[1:] == ["NAME", "PATH"]:
                    tokens = tokens[:1]
                if len(tokens) == 1:
                    tokens = example.get(tokens[0]) or [tokens[0], *VALUES.get(tokens[0], [])]
                flags.append(tokens)
            if flags:
                rows.append(flags)
    return rows


def takes_value(flag: str) -> bool:
    action = next((a for a in build_parser()._actions if flag in a.option_strings), None)
    assert action is not None, f"the doc calls {flag} the same, and it is not a flag here"
    return action.nargs != 0


def test_every_flag_the_doc_calls_the_same_parses_with_its_value() -> None:
    rows = documented_flags()
    assert sum(len(flags) for flags in rows) >= 40, rows  # the tables were read
    for flags in rows:
        assert all(len(f) > 1 or not takes_value(f[0]) for f in flags), f"give VALUES a value for {flags}"
        cfg = parse_args(BASE_ARGV + [token for f in flags for token in f])
        for tokens in flags:
            dest = next(a.dest for a in build_parser()._actions if tokens[0] in a.option_strings)
            value = getattr(cfg, dest)
            if len(tokens) == 1:
                assert value is True, (tokens, value)
            elif len(tokens) == 2 and isinstance(value, (int, float, str)) and not isinstance(value, bool):
                assert value == type(value)(tokens[1]), (tokens, value)


def test_every_route_the_doc_calls_the_same_answers(data_root: Path, defaults: AdapterDefaults) -> None:
    routes = [re.match(r"`(GET|POST|DELETE) ([^`]+)`", cells[0]) for cells in same_rows("Control-plane HTTP API")]
    assert all(routes) and len(routes) >= 5, routes
    plane = ThreadedController(controller_config(data_root, defaults, n_slots=2))
    data = str(data_root / "data" / "train.jsonl")
    try:
        with httpx.Client(base_url=plane.url, trust_env=False, timeout=30) as http:
            # POST first (it makes the adapter the others name), DELETE last.
            order = {"POST": 0, "GET": 1, "DELETE": 2}
            for match in sorted(routes, key=lambda m: order[m.group(1)]):
                method, path = match.groups()
                path = path.replace("{name}", "a").replace("names=...", "names=a")
                body = {"name": "a", "config": {"data": data}} if method == "POST" else None
                response = http.request(method, path, json=body)
                assert response.status_code == 200, (method, path, response.text)
    finally:
        plane.close()
