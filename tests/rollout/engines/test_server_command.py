"""Command lines of the engines and the router, built from the typed config.

The SGLang command is checked, on every machine, against the flags SGLang 0.5.23's own
argument parser defines: saved beside this test (`sglang_0_5_23_server_flags.json`, with
the version it came from), the source of truth, refreshed from a real SGLang install by

    .venv-sglang/bin/python scripts/sglang_server_flags.py --out tests/rollout/engines/sglang_0_5_23_server_flags.json

(`make gpu-check` installs SGLang in .venv-sglang; SGLang is never installed in the
trainer's environment, whose torch and transformers it would replace).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from miles.rollout.engines.fleet import EngineFleetConfig
from miles.rollout.engines.router import build_router_command
from miles.rollout.engines.server_command import (
    EngineServerConfig,
    build_builtin_command,
    build_sglang_command,
    server_command,
)
from miles.utils.arguments import parse_args
from tests.helpers.project_scripts import SCRIPTS_DIR, load_script
from tests.helpers.sglang_flags import SGLANG_FLAGS, check_lora_limits, parser_from_flag_list


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Values after `flag` up to the next flag."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def test_sglang_command_carries_the_lora_flags():
    cfg = EngineServerConfig.from_config(parse_args([
        "--hf-checkpoint", "/models/qwen", "--rollout-engine", "sglang", "--multi-lora-n-adapters", "6",
        "--lora-rank", "32", "--target-modules", "q_proj,v_proj", "--device", "cuda", "--dtype", "bfloat16",
        "--rollout-num-gpus-per-engine", "2", "--seed", "3",
    ]))
    argv = build_sglang_command(cfg, "127.0.0.1", 30001)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag_values(argv, "--model-path") == ["/models/qwen"]
    assert "--enable-lora" in argv
    assert flag_values(argv, "--max-loras-per-batch") == ["7"]  # 6 slots + the base model
    assert flag_values(argv, "--max-loaded-loras") == ["7"]
    assert flag_values(argv, "--tokenizer-worker-num") == ["1"]
    assert flag_values(argv, "--max-lora-rank") == ["32"]
    assert flag_values(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag_values(argv, "--tp-size") == ["2"]
    assert flag_values(argv, "--dtype") == ["bfloat16"]
    assert flag_values(argv, "--port") == ["30001"] and flag_values(argv, "--host") == ["127.0.0.1"]
    assert flag_values(argv, "--random-seed") == ["3"]
    assert server_command(cfg, "127.0.0.1", 30001) == argv


def test_all_linear_is_spelled_all_for_sglang_and_slots_default_to_one():
    cfg = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--rollout-engine", "sglang"]))
    assert cfg.n_slots == 1  # multi-LoRA off still serves one LoRA (train_async)
    assert flag_values(build_sglang_command(cfg, "h", 1), "--lora-target-modules") == ["all"]
    builtin = server_command(EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m"])), "h", 1)
    assert builtin[2] == "miles.rollout.engines.builtin_server"
    assert flag_values(builtin, "--lora-target-modules") == ["all-linear"]
    assert flag_values(builtin, "--num-threads") == ["1"]


def test_lora_unembed_adds_lm_head_to_both_servers_targets():
    sglang = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--rollout-engine", "sglang",
                                                        "--lora-unembed"]))
    assert flag_values(build_sglang_command(sglang, "h", 1), "--lora-target-modules") == ["all", "lm_head"]
    builtin = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--lora-unembed",
                                                         "--target-modules", "q_proj,v_proj"]))
    assert flag_values(server_command(builtin, "h", 1), "--lora-target-modules") == ["q_proj", "v_proj", "lm_head"]


def test_builtin_engine_threads_come_from_the_flag():
    cfg = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--engine-num-threads", "3"]))
    assert flag_values(server_command(cfg, "h", 1), "--num-threads") == ["3"]


def test_fleet_config_reads_router_and_engine_flags(tmp_path):
    cfg = parse_args(["--hf-checkpoint", "/m", "--rollout-num-engines", "3", "--sglang-router-ip", "10.0.0.2",
                      "--sglang-router-port", "31000", "--multi-lora-n-adapters", "4", "--run-dir", str(tmp_path)])
    fleet = EngineFleetConfig.from_config(cfg)
    assert (fleet.num_engines, fleet.router_ip, fleet.router_port) == (3, "10.0.0.2", 31000)
    assert fleet.server.n_slots == 4 and fleet.router_policy == "round_robin"
    assert fleet.work_dir == str((tmp_path / "engines").resolve())


def test_missing_checkpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        EngineServerConfig.from_config(parse_args([]))


def test_router_command():
    argv = build_router_command(["http://a:1", "http://b:2"], "127.0.0.1", 30000, "round_robin", prometheus_port=29001)
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert flag_values(argv, "--worker-urls") == ["http://a:1", "http://b:2"]
    assert flag_values(argv, "--policy") == ["round_robin"]
    assert flag_values(argv, "--prometheus-port") == ["29001"]


REFRESH_SCRIPT = SCRIPTS_DIR / "sglang_server_flags.py"
SGLANG_CASES = [
    ["--multi-lora-n-adapters", "6", "--lora-rank", "32", "--target-modules", "q_proj,v_proj", "--dtype", "bfloat16"],
    ["--multi-lora-n-adapters", "1", "--lora-rank", "8", "--target-modules", "all-linear", "--dtype", "float32"],
]


def sglang_commands() -> list[tuple[str, int, list[str]]]:
    """(mode, slots, the arguments after `python -m sglang.launch_server`) for each case."""
    commands = []
    for mode in ("in_place", "versioned"):
        for flags in SGLANG_CASES:
            miles_cfg = parse_args(["--hf-checkpoint", "/models/m", "--rollout-engine", "sglang", "--device", "cuda",
                                    *flags])
            cfg = EngineServerConfig.from_config(miles_cfg, lora_update=mode)
            commands.append((mode, int(flags[1]), build_sglang_command(cfg, "127.0.0.1", 30001)[3:]))
    return commands


@pytest.mark.parametrize("mode, n_slots, argv", sglang_commands())
def test_sglang_command_parses_with_sglang_0_5_flags(mode, n_slots, argv):
    args, unknown = parser_from_flag_list().parse_known_args(argv)
    assert unknown == [], f"not SGLang 0.5 flags: {unknown}"
    check_lora_limits(mode, args, n_slots)


def test_flag_list_rejects_what_sglang_rejects():
    parser = parser_from_flag_list()
    assert parser.parse_known_args(["--pause-generation-mode", "in_place"])[1]  # not a 0.5 server flag
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--dtype", "float64"])
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--lora-target-modules", "all-linear"])  # SGLang spells it "all"


def test_the_flag_list_is_what_the_refresh_script_writes():
    """Read into a parser and described again, the saved list is its own file byte for byte:
    a refresh from a real SGLang changes the lines SGLang changed and nothing else, and
    what the tests parse with is what the file says."""
    refresh = load_script("sglang_server_flags.py")
    text = SGLANG_FLAGS.read_text()
    version = json.loads(text)["sglang_version"]
    assert SGLANG_FLAGS.name == f"sglang_{version.replace('.', '_')}_server_flags.json"
    assert refresh.render(version, refresh.describe(parser_from_flag_list())) == text
    assert len(json.loads(text)["flags"]) == 560  # README ("Status of the GPU paths") states the number


def test_the_refresh_script_describes_every_kind_of_option():
    refresh = load_script("sglang_server_flags.py")
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-target-modules", nargs="*", choices=["q_proj", "all"])
    parser.add_argument("--json-model-override-args", type=json.loads)  # a converter of its own
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction)
    parser.add_argument("-v", "--verbose", action="count")
    switch = {"nargs": 0, "choices": None, "type": None}
    assert refresh.describe(parser) == {
        "--enable-lora": switch, "--help": switch, "--overlap": switch, "--no-overlap": switch, "--verbose": switch,
        "--json-model-override-args": {"nargs": 1, "choices": None, "type": None},
        "--lora-target-modules": {"nargs": "*", "choices": ["q_proj", "all"], "type": None},
        "--mem-fraction-static": {"nargs": 1, "choices": None, "type": "float"},
        "--tensor-parallel-size": {"nargs": 1, "choices": None, "type": "int"},
        "--tp-size": {"nargs": 1, "choices": None, "type": "int"},
    }
    assert list(refresh.describe(parser)) == sorted(refresh.describe(parser))


def test_the_refresh_script_writes_what_the_installed_sglang_defines(tmp_path):
    """Run as documented, by an interpreter where `sglang` imports (here a stand-in package
    with two server flags): the file holds that version and exactly its flags."""
    server_args = tmp_path / "pkgs" / "sglang" / "srt"
    server_args.mkdir(parents=True)
    (tmp_path / "pkgs" / "sglang" / "__init__.py").write_text('__version__ = "9.9.9"\n')
    (server_args / "__init__.py").write_text("")
    (server_args / "server_args.py").write_text(
        "class ServerArgs:\n"
        "    @staticmethod\n"
        "    def add_cli_args(parser):\n"
        "        parser.add_argument('--max-lora-rank', type=int)\n"
        "        parser.add_argument('--enable-lora', action='store_true')\n")
    out = tmp_path / "flags.json"
    done = subprocess.run([sys.executable, str(REFRESH_SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "pkgs")}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    spec = json.loads(out.read_text())
    assert spec["sglang_version"] == "9.9.9"
    assert spec["flags"] == {"--enable-lora": {"nargs": 0, "choices": None, "type": None},
                             "--help": {"nargs": 0, "choices": None, "type": None},
                             "--max-lora-rank": {"nargs": 1, "choices": None, "type": "int"}}


def test_the_refresh_script_says_which_interpreter_to_run_it_with(tmp_path, capsys, monkeypatch):
    """Under an interpreter without SGLang (the trainer's, on purpose) it says which one to
    use and writes nothing."""
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` raises ImportError
    assert load_script("sglang_server_flags.py").main(["--out", str(tmp_path / "flags.json")]) == 2
    assert ".venv-sglang/bin/python" in capsys.readouterr().err
    assert not (tmp_path / "flags.json").exists()


def test_builtin_command_takes_the_same_capacity_and_mode():
    cfg = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--multi-lora-n-adapters", "3"]),
                                         lora_update="versioned")
    argv = server_command(cfg, "127.0.0.1", 1)
    assert flag_values(argv, "--engine-lora-update") == ["versioned"]
    assert flag_values(argv, "--max-loras-per-batch") == flag_values(argv, "--max-loaded-loras") == ["7"]


def test_sampler_snapshots_add_room_to_max_loaded_loras_only():
    cfg = EngineServerConfig.from_config(parse_args(["--hf-checkpoint", "/m", "--multi-lora-n-adapters", "3"]))
    with_snapshots = dataclasses.replace(cfg, sampler_snapshots=5)
    for build in (build_builtin_command, build_sglang_command):
        argv = build(with_snapshots, "127.0.0.1", 1)
        assert flag_values(argv, "--max-loras-per-batch") == ["4"]  # 3 slots + the base model
        assert flag_values(argv, "--max-loaded-loras") == ["9"]


def test_sglang_runs_under_the_interpreter_given_by_engine_python():
    cfg = EngineServerConfig.from_config(parse_args([
        "--hf-checkpoint", "/models/qwen", "--rollout-engine", "sglang", "--multi-lora-n-adapters", "2",
        "--engine-python", "/opt/sglang-env/bin/python",
    ]))
    argv = build_sglang_command(cfg, "127.0.0.1", 30001)
    assert argv[:3] == ["/opt/sglang-env/bin/python", "-m", "sglang.launch_server"]
