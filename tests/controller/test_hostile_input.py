"""Malformed and hostile requests against the control plane on loopback.

Each request of the table gets a 4xx whose detail names the problem; afterwards the
registry is exactly as before and `/health` still answers. Files the requests point at
(FIFOs, device symlinks, directories, traversals, YAML with aliases or Python tags) are
made on the spot under the test's own directory.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.controller.backend import MultiLoRABackend
from miles.controller.registry import AdapterValidationError
from miles.utils.adapter_config import AdapterDefaults
from tests.helpers.controller_fakes import ThreadedController, controller_config

TOKEN = "hostile-test-token"
HOSTILE_CASES = 93
"""Requests in `cases()`; docs/RELIABILITY.md ("Hostile and malformed input") states this number."""
RELIABILITY = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"
CANARY = "tests.helpers.plugin_canary"
"""A module no registration over HTTP may get imported."""


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults) -> Iterator[ThreadedController]:
    controller = ThreadedController(controller_config(data_root, defaults, n_slots=2, token=TOKEN))
    yield controller
    controller.close()


@pytest.fixture
def http(plane: ThreadedController) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plane.url, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False,
                      timeout=30) as client:
        yield client


def hostile_files(root: Path) -> dict[str, str]:
    """Paths inside the allowed root that must still be refused, each for its own reason."""
    files = root / "hostile"
    files.mkdir()
    os.mkfifo(files / "fifo.jsonl")
    os.mkfifo(files / "fifo.yaml")
    (files / "zero.jsonl").symlink_to("/dev/zero")
    (files / "escape.jsonl").symlink_to("/etc/hostname")
    (files / "dir.jsonl").mkdir()
    (files / "outside_dir").symlink_to("/tmp")
    (files / "empty.jsonl").write_text("")
    (files / "not_rows.jsonl").write_text("[1, 2]\n")
    (files / "no_text.jsonl").write_text(json.dumps({"question": "1+1", "label": "2"}) + "\n")
    (files / "broken.jsonl").write_text('{"text": "1+1", "label": \n')
    (files / "train.txt").write_text("1+1=2\n")
    data = str(root / "data" / "train.jsonl")
    yamls = {
        "alias.yaml": f"data: {data}\nmetadata:\n  a: &a [1]\n  b: *a\n",
        "python.yaml": f"data: {data}\nmetadata: !!python/object/apply:os.system ['touch {files}/pwned']\n",
        "list.yaml": f"- data: {data}\n",
        "unknown.yaml": f"data: {data}\nranq: 4\n",
        "badtype.yaml": f"data: {data}\nrank: eight\n",
        "tabs.yaml": "data:\t[unclosed\n",
        "plugin.yaml": f"data: {data}\ncustom_rm_path: os.system\n",
    }
    for file_name, text in yamls.items():
        (files / file_name).write_text(text)
    (files / "huge.yaml").write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    return {"dir": str(files), "data": data}


def cases(root: Path, paths: dict[str, str]) -> list[tuple[str, dict[str, Any], int, str]]:
    """(label, request kwargs for POST /adapter_runs, status, words the detail must contain)."""
    data, d = paths["data"], paths["dir"]

    def reg(name: Any = "x", **config: Any) -> dict[str, Any]:
        return {"json": {"name": name, "config": {"data": data, **config}}}

    def prio(priority: Any) -> dict[str, Any]:
        return {"json": {"name": "x", "config": {"data": data}, "priority": priority}}

    def from_yaml(file_name: str) -> dict[str, Any]:
        return {"json": {"name": "x", "yaml_path": f"{d}/{file_name}"}}

    def body(raw: bytes, content_type: str = "application/json") -> dict[str, Any]:
        return {"content": raw, "headers": {"Content-Type": content_type}}

    return [
        # -- not JSON / wrong shape
        ("non-JSON", body(b"{name: x"), 422, "Malformed body"),
        ("empty body", body(b""), 422, "valid dictionary"),
        ("JSON list", body(b"[1, 2]"), 422, "valid dictionary"),
        ("JSON string", body(b'"x"'), 422, "valid dictionary"),
        ("form encoded", body(b"name=x&data=y", "application/x-www-form-urlencoded"), 422, "Malformed body"),
        ("invalid UTF-8", body(b'{"name": "\xff\xfe"}'), 422, "Malformed body"),
        ("10 MB body", body(b'{"name": "' + b"x" * (10 << 20) + b'"}'), 413, "larger than 1048576 bytes"),
        ("missing name", {"json": {"config": {"data": data}}}, 422, "Field required"),
        ("name not a string", {"json": {"name": 5, "config": {"data": data}}}, 422, "'loc': ['body', 'name']"),
        ("unknown top-level key", {"json": {"name": "x", "config": {"data": data}, "admin": True}}, 422,
         "Extra inputs are not permitted"),
        ("config and yaml_path", {"json": {"name": "x", "config": {"data": data}, "yaml_path": "a.yaml"}}, 400,
         "exactly one of"),
        ("neither config nor yaml_path", {"json": {"name": "x"}}, 400, "exactly one of"),
        ("config a string", {"json": {"name": "x", "config": "data.jsonl"}}, 422, "valid dictionary"),
        ("config without data", {"json": {"name": "x", "config": {"rank": 4}}}, 422,
         "'loc': ['body', 'config', 'data']"),
        # -- the queue priority: a whole number in -1,000,000..1,000,000, top-level only
        ("priority as string", prio("5"), 422, "'loc': ['body', 'priority']"),
        ("priority as float", prio(1.5), 422, "'loc': ['body', 'priority']"),
        ("priority as bool", prio(True), 422, "'loc': ['body', 'priority']"),
        ("priority null", prio(None), 422, "'loc': ['body', 'priority']"),
        ("priority a list", prio([1]), 422, "'loc': ['body', 'priority']"),
        ("priority over the bound", prio(1_000_001), 422, "less than or equal to 1000000"),
        ("priority under the bound", prio(-1_000_001), 422, "greater than or equal to -1000000"),
        ("huge priority", prio(10**30), 422, "less than or equal to 1000000"),
        ("priority inside config", reg(priority=5), 422, "'loc': ['body', 'config', 'priority']"),
        # -- field types and ranges
        ("unknown config key", reg(rnak=4), 422, "'loc': ['body', 'config', 'rnak']"),
        ("rank as string", reg(rank="8"), 422, "'loc': ['body', 'config', 'rank']"),
        ("rank as bool", reg(rank=True), 422, "'loc': ['body', 'config', 'rank']"),
        ("negative rank", reg(rank=-1), 422, "greater than 0"),
        ("huge rank", reg(rank=10**30), 400, "exceeds the slot width"),
        ("zero batch", reg(rollout_batch_size=0), 422, "'loc': ['body', 'config', 'rollout_batch_size']"),
        ("huge batch", reg(rollout_batch_size=10**12), 400, "--multi-lora-max-adapter-global-batch-size"),
        ("negative samples", reg(n_samples_per_prompt=-4), 422, "n_samples_per_prompt"),
        ("negative lr", reg(lr=-0.1), 422, "greater than or equal to 0"),
        ("infinite alpha", body(json.dumps({"name": "x", "config": {"data": data, "alpha": float("inf")}}).encode()),
         422, "finite number"),
        ("NaN lr", body(json.dumps({"name": "x", "config": {"data": data, "lr": float("nan")}}).encode()),
         422, "finite number"),
        ("float num_step", reg(num_step=2.5), 422, "'loc': ['body', 'config', 'num_step']"),
        ("negative warmup", reg(lr_warmup_steps=-1), 422, "lr_warmup_steps"),
        ("unknown decay style", reg(lr_decay_style="exponential"), 422, "lr_decay_style"),
        ("metadata a list", reg(metadata=[1, 2]), 422, "'loc': ['body', 'config', 'metadata']"),
        ("metadata too large", reg(metadata={"blob": "x" * 70_000}), 422, "at most 65536 are accepted"),
        ("empty data", reg(data=""), 422, "'loc': ['body', 'config', 'data']"),
        # -- names
        ("name with ::", reg("a::b"), 400, "Invalid adapter name"),
        ("name with /", reg("a/b"), 400, "Invalid adapter name"),
        ("name ..", reg(".."), 400, "Invalid adapter name"),
        ("name traversal", reg("../../etc"), 400, "Invalid adapter name"),
        ("unicode name", reg("ädäpter"), 400, "Invalid adapter name"),
        ("right-to-left override", reg("a\u202eb"), 400, "Invalid adapter name"),
        ("newline in name", reg("a\nb"), 400, "Invalid adapter name"),
        ("NUL in name", reg("a\x00b"), 400, "Invalid adapter name"),
        ("empty name", reg(""), 400, "Invalid adapter name"),
        ("5,000-character name", reg("n" * 5000), 400, "use at most 64"),
        # -- paths: traversal, symlinks, special files
        ("data traversal", reg(data=f"{root}/data/../../../etc/passwd.jsonl"), 400, "outside the allowed roots"),
        ("data outside roots", reg(data="/etc/passwd.jsonl"), 400, "outside the allowed roots"),
        ("data symlink out of the roots", reg(data=f"{d}/escape.jsonl"), 400, "outside the allowed roots"),
        ("data .jsonl symlink to /dev/zero", reg(data=f"{d}/zero.jsonl"), 400, "outside the allowed roots"),
        ("data a FIFO", reg(data=f"{d}/fifo.jsonl"), 400, "is not a regular file (a FIFO"),
        ("data a directory", reg(data=f"{d}/dir.jsonl"), 400, "is not a regular file (a directory"),
        ("data missing", reg(data=f"{d}/missing.jsonl"), 400, "does not exist"),
        ("data wrong extension", reg(data=f"{d}/train.txt"), 400, "must be a .jsonl, .json or .parquet file"),
        ("data with NUL", reg(data=f"{d}/a\x00.jsonl"), 400, "NUL byte"),
        ("data empty file", reg(data=f"{d}/empty.jsonl"), 400, "empty"),
        ("data rows not objects", reg(data=f"{d}/not_rows.jsonl"), 400, "expected an object"),
        ("data without input key", reg(data=f"{d}/no_text.jsonl"), 400, "has no input_key 'text'"),
        ("data broken JSON", reg(data=f"{d}/broken.jsonl"), 400, "line 1 is not valid JSON"),
        ("save traversal", reg(save=f"{root}/../../escape"), 400, "outside the allowed roots"),
        ("save symlink out of the roots", reg(save=f"{d}/outside_dir/s"), 400, "outside the allowed roots"),
        ("save with NUL", reg(save=f"{root}/s\x00"), 400, "NUL byte"),
        ("yaml_path outside roots", {"json": {"name": "x", "yaml_path": "/etc/passwd"}}, 400,
         "outside the allowed roots"),
        ("yaml_path traversal", {"json": {"name": "x", "yaml_path": f"{root}/../../etc/passwd"}}, 400,
         "outside the allowed roots"),
        ("yaml_path a FIFO", from_yaml("fifo.yaml"), 400, "is not a regular file (a FIFO"),
        ("yaml_path missing", from_yaml("nope.yaml"), 400, "does not exist"),
        ("yaml_path over 1 MiB", from_yaml("huge.yaml"), 400, "larger than 1048576 bytes"),
        # -- YAML
        ("YAML aliases in a file", from_yaml("alias.yaml"), 400, "anchors and aliases"),
        ("YAML Python tag in a file", from_yaml("python.yaml"), 400, "is not valid YAML"),
        ("YAML a list", from_yaml("list.yaml"), 400, "must be a mapping of fields"),
        ("YAML unknown key", from_yaml("unknown.yaml"), 400, "unknown key(s) ['ranq']"),
        ("YAML wrong type", from_yaml("badtype.yaml"), 400, "rank: Input should be a valid integer"),
        ("YAML syntax error", from_yaml("tabs.yaml"), 400, "is not valid YAML"),
        ("YAML body with aliases", body(b"name: x\nconfig: &c {data: a.jsonl}\nother: *c\n", "application/yaml"),
         422, "anchors and aliases"),
        ("YAML body with a Python tag",
         body(b"name: !!python/object/apply:os.getcwd []\nconfig: {data: a.jsonl}\n", "application/yaml"),
         422, "Malformed body"),
        # -- rewards and plug-ins
        ("unknown rm_type", reg(rm_type="no_such_reward"), 400, "unknown rm_type"),
        ("custom_rm_path not importable", reg(custom_rm_path="no_such_module.reward"), 400, "no_such_module"),
        ("custom_rm_path not dotted", reg(custom_rm_path="reward"), 400, "custom_rm_path"),
        ("filter path not importable", reg(dynamic_sampling_filter_path="nope.nope.f"), 400,
         "dynamic_sampling_filter_path"),
        # -- plug-ins outside the allowed modules: refused before anything is imported
        ("custom_rm_path subprocess.run", reg(custom_rm_path="subprocess.run"), 400,
         "custom_rm_path 'subprocess.run' is outside the modules a registration may name (miles)"),
        ("generate function os.system", reg(custom_generate_function_path="os.system"), 400,
         "--multi-lora-allowed-plugin-modules"),
        ("filter shutil.rmtree", reg(dynamic_sampling_filter_path="shutil.rmtree"), 400,
         "dynamic_sampling_filter_path 'shutil.rmtree' is outside"),
        ("TIS function os.system", reg(loss={"use_tis": True, "custom_tis_function_path": "os.system"}), 400,
         "loss.custom_tis_function_path 'os.system' is outside"),
        ("a module named like miles", reg(custom_rm_path="milesx.reward"), 400, "'milesx.reward' is outside"),
        ("a module never imported", reg(custom_rm_path=f"{CANARY}.reward"), 400, "is outside the modules"),
        ("plug-in named in a YAML file", from_yaml("plugin.yaml"), 400, "custom_rm_path 'os.system' is outside"),
        # -- plug-ins inside them, called as the rollout calls them
        ("generate function not async", reg(custom_generate_function_path="miles.utils.plugins.plugin_module"),
         400, "must be an async function"),
        ("generate function of two inputs",
         reg(custom_generate_function_path="miles.rollout.generate.call_generate_function"), 400,
         "custom_generate_function_path 'miles.rollout.generate.call_generate_function' has the wrong signature"),
        ("filter of one input", reg(dynamic_sampling_filter_path="miles.utils.plugins.plugin_module"), 400,
         "expected fn(args, samples)"),
    ]


def test_every_hostile_request_is_a_4xx_naming_the_problem_and_changes_nothing(
        plane: ThreadedController, http: httpx.Client, data_root: Path) -> None:
    paths = hostile_files(data_root)
    assert http.post("/adapter_runs", json={"name": "taken", "config": {"data": paths["data"]}}).status_code == 200
    table = cases(data_root, paths)
    # Every case counted, none twice: a case lost from the table (or a label pasted twice)
    # shows here, and docs/RELIABILITY.md states the same number.
    assert len({label for label, *_ in table}) == len(table) == HOSTILE_CASES
    assert f"`tests/controller/test_hostile_input.py`, {HOSTILE_CASES} cases" in RELIABILITY.read_text()
    failures = []
    for label, kwargs, status, words in table:
        before = plane.fingerprint()
        response = http.post("/adapter_runs", **kwargs)
        detail = str(response.json().get("detail")) if response.headers.get("content-type") == "application/json" \
            else response.text
        if response.status_code != status or words not in detail:
            failures.append(f"{label}: HTTP {response.status_code} {detail[:300]}")
        if plane.fingerprint() != before:
            failures.append(f"{label}: the registry changed")
        assert http.get("/health").json() == {"status": "healthy"}, label
    assert not failures, "\n".join(failures)
    assert not (Path(paths["dir"]) / "pwned").exists()
    assert CANARY not in sys.modules  # refused by its path, never imported


def test_plugins_in_the_allowed_modules_register(data_root: Path, defaults: AdapterDefaults) -> None:
    """`miles` by default, and what --multi-lora-allowed-plugin-modules adds."""
    modules = ("miles", "tests.helpers")
    controller = ThreadedController(controller_config(data_root, defaults, n_slots=3, token=TOKEN,
                                                      plugin_modules=modules))
    data = str(data_root / "data" / "train.jsonl")
    try:
        with httpx.Client(base_url=controller.url, headers={"Authorization": f"Bearer {TOKEN}"}, trust_env=False,
                          timeout=30) as http:
            for name, config in [
                ("calc", {"custom_rm_path": "miles.recipes.calculator_tool.reward",
                          "custom_generate_function_path": "miles.recipes.calculator_tool.generate"}),
                ("digits", {"custom_rm_path": "miles.recipes.tasks:digit_match_reward"}),
                ("canary", {"custom_rm_path": f"{CANARY}.reward"}),
            ]:
                response = http.post("/adapter_runs", json={"name": name, "config": {"data": data, **config}})
                assert response.status_code == 200, response.text
            assert http.get("/adapter_runs/canary").json()["custom_rm_path"] == f"{CANARY}.reward"
    finally:
        controller.close()


def test_other_routes_refuse_bad_names_and_methods(plane: ThreadedController, http: httpx.Client) -> None:
    before = plane.fingerprint()
    for method, path, status in [
        ("GET", "/adapter_runs/ghost", 404), ("DELETE", "/adapter_runs/ghost", 404),
        ("GET", "/adapter_runs/..%2F..%2Fetc", 404), ("DELETE", "/adapter_runs/" + "n" * 5000, 404),
        ("PUT", "/adapter_runs", 405), ("PATCH", "/adapter_runs/ghost", 405), ("GET", "/no/such/route", 404),
    ]:
        assert http.request(method, path).status_code == status, (method, path)
    states = http.get("/adapter_runs/state", params={"names": ["n" * 5000, "a::b", "\u202e"]}).json()["states"]
    assert set(states.values()) == {None}
    assert plane.fingerprint() == before


async def test_a_device_behind_a_jsonl_name_is_named_as_such_without_roots(
        tmp_path: Path, defaults: AdapterDefaults, data_root: Path) -> None:
    """The trainer's own registrations have no allowed roots: /dev/zero behind a .jsonl
    name is a character device, not a file with the wrong extension."""
    from tests.helpers.controller_fakes import ROLLOUT_HOOKS

    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    backend = MultiLoRABackend(1, defaults, hooks=ROLLOUT_HOOKS)
    with pytest.raises(AdapterValidationError, match=r"is not a regular file \(a character device"):
        await backend.register("z", config={"data": str(tmp_path / "zero.jsonl")})
    assert backend.snapshot().all_adapters_cleaned_up
