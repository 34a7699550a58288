"""scripts/scaling_sim.py on a tiny grid: its output has one point per grid cell with the
fields the capacity model reads, costs come from a benchmark JSON when one is given, and an
in_place push takes longer per iteration as engines are added (each engine has its own
weights-update group, sent to in turn), while a versioned one grows no faster."""

from __future__ import annotations

import json

from tests.helpers.project_scripts import load_script

scaling_sim = load_script("scaling_sim.py")


def test_tiny_grid_output_and_in_place_push_grows_with_engines(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert scaling_sim.main(["--adapters", "8,64", "--engines", "1,4,16", "--iterations", "3",
                             "--mitigations", "none,parallel_push", "--benchmarks", str(tmp_path / "none.json"),
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    points = result["points"]
    assert len(points) == 2 * 2 * 3 * 2  # mitigations x modes x engines x adapters
    assert {"adapters", "engines", "mode", "iteration_s", "overhead_share", "controller_busy", "push_s",
            "bottleneck"} <= points[0].keys()
    assert len(result["first_bottlenecks"]) == 4
    assert "First bottleneck" in capsys.readouterr().out

    def push(mode: str, mitigation: str = "none") -> list[float]:
        return [p["push_s"] for p in sorted(points, key=lambda p: p["engines"])
                if p["mode"] == mode and p["adapters"] == 8 and p["mitigation"] == mitigation]

    in_place, versioned = push("in_place"), push("versioned")
    assert in_place[0] < in_place[1] < in_place[2]
    assert in_place[2] / in_place[0] == 16  # one group per engine: E x the bytes from the exporting rank
    assert all(v <= i for v, i in zip(versioned, in_place))
    assert push("in_place", "parallel_push") == versioned
    iterations = [p["iteration_s"] for p in sorted(points, key=lambda p: p["engines"])
                  if p["mode"] == "in_place" and p["adapters"] == 8 and p["mitigation"] == "none"]
    assert iterations == sorted(iterations)


def test_costs_come_from_a_benchmark_json(tmp_path):
    figure = {"figure": "driver snapshot (build + Ray's cloudpickle + unpickle), 1,000 live adapters ÷ 8",
              "model": "tiny", "ours_median": 10.0, "baseline_median": 0.08,
              "params": {"bytes": {"8": 1000, "1000": 100_000}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"command": "python scripts/bench/control_plane_scale.py", "figures": [figure]}))
    costs = scaling_sim.load_costs([path])
    assert abs(costs.snapshot.at(1000) - 0.010) < 1e-12 and abs(costs.snapshot.at(8) - 0.00008) < 1e-12
    assert costs.snapshot_bytes.at(1000) == 100_000
    assert costs.snapshot.source == "python scripts/bench/control_plane_scale.py"
    assert costs.train_s == scaling_sim.Costs().train_s  # not in the file: the default
