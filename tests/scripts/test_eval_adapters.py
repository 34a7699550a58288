"""eval_adapters scores the base on every task and each adapter on every task, or only on
its own with --own-tasks, with the evaluator of the chosen recipe."""

from __future__ import annotations

from tests.helpers.project_scripts import load_script


def test_own_tasks_scores_each_adapter_on_its_task_only(monkeypatch, tmp_path):
    script = load_script("eval_adapters.py")
    calls = []

    def fake(base_dir, checkpoint, test_data, n):
        calls.append((checkpoint and checkpoint.name, test_data.name))
        return 0.5 if checkpoint is None else 0.75

    monkeypatch.setitem(script.EVALUATORS, "smollm2", fake)
    targets = [script.EvalTarget("a", tmp_path / "a_test.jsonl", tmp_path / "ckpt_a"),
               script.EvalTarget("b", tmp_path / "b_test.jsonl", tmp_path / "ckpt_b")]

    matrix = script.accuracy_matrix("base", targets, 10, "smollm2", own_tasks=True)
    assert matrix == {"base": {"a": 0.5, "b": 0.5}, "a": {"a": 0.75}, "b": {"b": 0.75}}
    assert sorted(calls, key=str) == sorted([(None, "a_test.jsonl"), (None, "b_test.jsonl"),
                                             ("ckpt_a", "a_test.jsonl"), ("ckpt_b", "b_test.jsonl")], key=str)
    lines = script.format_matrix(matrix).splitlines()
    assert lines[0].split() == ["model", "a", "b"]
    assert lines[2].split() == ["a", "75.0%*", "-"] and lines[3].split() == ["b", "-", "75.0%*"]

    calls.clear()
    full = script.accuracy_matrix("base", targets, 10, "smollm2")
    assert len(calls) == 6 and full["a"] == {"a": 0.75, "b": 0.75}
