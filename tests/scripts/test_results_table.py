"""scripts/results_table.py: the docs' accuracy tables are rendered from eval_adapters runs."""

from __future__ import annotations

import pytest

from tests.helpers.project_scripts import load_script

results_table = load_script("results_table.py")


def run(base_add: float, add_add: float, steps: int) -> dict:
    return {"n": 100, "steps": {"add": steps},
            "accuracy": {"base": {"add": base_add, "sub": 0.5}, "add": {"add": add_add, "sub": 0.25}}}


def test_one_run_shows_each_cell_and_the_own_task_gain():
    table = results_table.render([run(0.3, 0.45, 40)])
    assert "| base | 30.0% | 50.0% |" in table
    assert "| adapter `add` (40 steps) | **45.0%** (+15.0 points) | 25.0% |" in table
    assert "the first 100 held-out rows" in table and "1 run;" in table


def test_several_runs_show_the_mean_and_the_range():
    table = results_table.render([run(0.3, 0.45, 40), run(0.2, 0.55, 40)])
    assert "| base | 25.0% (20.0%-30.0%) | 50.0% (50.0%-50.0%) |" in table
    assert "**50.0% (45.0%-55.0%)** (+15.0 to +35.0 points)" in table
    with pytest.raises(ValueError, match="scored different models"):
        results_table.render([run(0.3, 0.45, 40), {"accuracy": {"base": {"add": 0.1}}, "steps": {}}])


def test_update_rewrites_only_its_block(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("before\n<!-- demo-results:begin -->\nold\n<!-- demo-results:end -->\nafter\n")
    results_table.update_block(doc, "demo-results", "new table")
    assert doc.read_text() == "before\n<!-- demo-results:begin -->\nnew table\n<!-- demo-results:end -->\nafter\n"
    with pytest.raises(ValueError, match="needs exactly one"):
        results_table.update_block(doc, "other-block", "x")
