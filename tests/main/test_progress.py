"""What the driver records and shows per trained batch, from hand-made batches.

One adapter record per optimizer step (the step's batches merged), dynamic-filter drops
since the previous step, a re-registration's partial step discarded, the gauges the
controller serves, the live table on a terminal and plain lines otherwise; a client-driven
adapter's record per `optim_step`, its row, line and summary.
"""

from __future__ import annotations

import doctest
import io
import logging
import sys
from pathlib import Path

import pytest
from rich.console import Console

from miles.backends.base import AdapterStepStats, AdapterTrainStats, TrainResult
from miles.main import client_commands
from miles.main.client_commands import ClientCall, ClientModelReport, ClientStepTaken, reduce_metrics
from miles.main.progress import RunProgress
from miles.main.progress.console import LiveTableView, PlainView, make_view
from miles.main.train_step import TrainedBatch
from miles.utils.adapter_config import AdapterRunConfig
from miles.utils.tracking import MetricsLogger, read_metrics
from miles.utils.types import (
    AdamStep,
    AdapterGauges,
    AdapterRolloutStats,
    AdapterRun,
    AdapterState,
    ClientAdapterRun,
    ClientModelConfig,
    GenerationCounts,
    MultiLoRASnapshot,
    RolloutBatch,
    RolloutStats,
    Sample,
)


def run(name: str, slot: int, step: int, *, num_step: int | None = 3, registration_id: str | None = None,
        accumulated: int = 0) -> AdapterRun:
    config = AdapterRunConfig(data="unused.jsonl", rollout_batch_size=2, n_samples_per_prompt=2, num_step=num_step)
    return AdapterRun(name=name, config=config, slot=slot, version=step + 1, step=step,
                      accumulated_groups=accumulated, registration_id=registration_id or f"reg-{name}")


def snapshot(*runs: AdapterRun, completed: frozenset[str] = frozenset(),
             clients: tuple[ClientAdapterRun, ...] = ()) -> MultiLoRASnapshot:
    return MultiLoRASnapshot(active={r.name: r for r in runs}, completed=completed,
                             clients={c.name: c for c in clients})


def client_run(name: str, slot: int, step: int, *, resume_from: str | None = None) -> ClientAdapterRun:
    config = ClientModelConfig(model_id=name.replace(".", ":"), session_id="s", base_model="base", rank=4,
                               alpha=8.0, save="/unused")
    return ClientAdapterRun(name=name, config=config, state=AdapterState.ACTIVE, slot=slot, version=0, step=step,
                            registration_id=f"reg-{name}", resume_from=resume_from)


def client_report(name: str, losses: list[float], *, lr: float | None = None, seconds: float = 0.5,
                  registration_id: str | None = None) -> ClientModelReport:
    """forward_backward calls of two datums and 6 tokens each, with these `loss:sum`s; `lr`: then an optim_step."""
    step = None if lr is None else ClientStepTaken(AdamStep(learning_rate=lr, weight_decay=0.01),
                                                   AdapterStepStats(grad_norm=2.5, lr=lr))
    return ClientModelReport(name, registration_id or f"reg-{name}",
                             [ClientCall({"loss:sum": loss}, datums=2, tokens=6) for loss in losses], step, seconds)


def batch(rollout_id: int, per_adapter: dict[str, AdapterRolloutStats], step_names: list[str]) -> RolloutBatch:
    return RolloutBatch(rollout_id=rollout_id, samples=[], prompt_group_sizes=[],
                        groups_per_adapter={n: s.groups for n, s in per_adapter.items() if s.groups},
                        step_names=step_names, per_adapter=per_adapter,
                        stats=RolloutStats(batch_n_adapters=len(per_adapter), batch_n_adapters_to_step=len(step_names)))


def trained(train: dict[str, AdapterTrainStats], steps: list[str]) -> TrainedBatch:
    return TrainedBatch(TrainResult(samples=sum(t.samples for t in train.values()), adapters=train),
                        {name: AdapterStepStats(grad_norm=1.5, lr=1e-3) for name in steps})


def train_stats(samples: int, loss: float) -> AdapterTrainStats:
    return AdapterTrainStats(samples=samples, loss=loss, clip_fraction=0.0, kl=0.0, tis_weight=1.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class RecordingController:
    """Takes `observe_rollout` like the controller actor handle (`.remote` awaitable)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, AdapterGauges]] = []

        async def remote(gauges: dict[str, AdapterGauges]) -> None:
            self.reports.append(gauges)

        self.observe_rollout = type("Method", (), {"remote": staticmethod(remote)})()


@pytest.fixture
def metrics(tmp_path):
    logger = MetricsLogger(tmp_path)
    yield logger
    logger.close()


async def test_one_adapter_record_per_optimizer_step_with_the_steps_batches_merged(metrics):
    """`a` takes two batches per step, `b` one: `a` gets one record, at its new step, with
    statistics over both batches; drops per filter reason are those since its last record."""
    clock = Clock()
    controller = RecordingController()
    progress = RunProgress(metrics, clock=clock, controller=controller)
    progress.declare(snapshot(run("a", 0, 0), run("b", 1, 0)))

    a1 = AdapterRolloutStats(groups=1, rewards=(1.0, 1.0), response_lengths=(2, 4), uniform_group_rewards=(1.0,),
                             staleness=(0,), queue_length=5,
                             generation=GenerationCounts(filtered=3, filtered_by_reason={"zero_std_0.0": 3}))
    b1 = AdapterRolloutStats(groups=2, rewards=(0.0, 0.0, 0.0, 1.0), response_lengths=(1, 1, 1, 1),
                             uniform_group_rewards=(0.0,), staleness=(1, 1), queue_length=0)
    clock.t = 110.0
    await progress.record(0, batch(0, {"a": a1, "b": b1}, ["b"]),
                          trained({"a": train_stats(2, 1.0), "b": train_stats(4, 0.5)}, ["b"]),
                          snapshot(run("a", 0, 0, accumulated=1), run("b", 1, 1)), {"perf/train_time": 0.5})
    records = read_metrics(metrics.path)
    assert [(r["adapter"], r["step"]) for r in records if r["kind"] == "adapter"] == [("b", 1)]

    a2 = AdapterRolloutStats(groups=1, rewards=(0.0, 1.0), response_lengths=(6, 8), truncated=1, staleness=(2,),
                             queue_length=1,
                             generation=GenerationCounts(filtered=6, filtered_by_reason={"zero_std_0.0": 5,
                                                                                           "zero_std_1.0": 1}))
    clock.t = 120.0
    await progress.record(1, batch(1, {"a": a2, "b": AdapterRolloutStats()}, ["a"]),
                          trained({"a": train_stats(2, 3.0)}, ["a"]),
                          snapshot(run("a", 0, 1), run("b", 1, 1)), {"perf/train_time": 0.5})

    records = read_metrics(metrics.path)
    adapter = [r for r in records if r["kind"] == "adapter"]
    assert [(r["adapter"], r["step"]) for r in adapter] == [("b", 1), ("a", 1)]
    a = adapter[1]["metrics"]
    assert a["raw_reward_mean"] == 0.75 and (a["raw_reward_median"], a["raw_reward_min"]) == (1.0, 0.0)
    assert (a["response_len_mean"], a["response_len_median"], a["response_len_max"]) == (5.0, 5.0, 8.0)
    assert a["truncated_ratio"] == 0.25
    assert (a["zero_std_all_one_percentage"], a["zero_std_all_zero_percentage"]) == (0.5, 0.0)
    assert (a["avg_staleness"], a["max_staleness"]) == (1.0, 2.0)
    assert a["loss"] == 2.0 and a["train_samples"] == 4.0  # sample-weighted over the two batches
    assert (a["grad_norm"], a["lr"], a["perf/step_batches"], a["perf/queue_length"]) == (1.5, 1e-3, 2.0, 1.0)
    assert a["dynamic_filter/drop_zero_std_0.0"] == 5.0 and a["dynamic_filter/drop_zero_std_1.0"] == 1.0
    b = adapter[0]["metrics"]
    assert b["raw_reward_mean"] == 0.25 and b["zero_std_all_zero_percentage"] == 0.5 and b["max_staleness"] == 1.0
    # Trained samples per second since each adapter appeared (at t=100): b 4 by t=110, a 2 + 2 by t=120.
    assert (b["perf/samples_per_s"], a["perf/samples_per_s"]) == (0.4, 0.2)
    loop = [r for r in records if r["kind"] == "loop"]
    assert [r["metrics"]["perf/rollout/batch_n_adapters_to_step"] for r in loop] == [1.0, 1.0]

    # The controller hears each adapter's latest step reward and buffered groups.
    assert controller.reports[-1] == {
        "a": AdapterGauges(registration_id="reg-a", raw_reward_mean=0.75, groups_buffered=1),
        "b": AdapterGauges(registration_id="reg-b", raw_reward_mean=0.25, groups_buffered=0),
    }
    assert controller.reports[0]["a"].raw_reward_mean is None  # no step yet

    # The next step's record counts the filter's drops since this one only.
    a3 = AdapterRolloutStats(groups=2, rewards=(1.0,) * 4, response_lengths=(1,) * 4,
                             generation=GenerationCounts(filtered=8, filtered_by_reason={"zero_std_0.0": 7,
                                                                                           "zero_std_1.0": 1}))
    await progress.record(2, batch(2, {"a": a3}, ["a"]), trained({"a": train_stats(4, 1.0)}, ["a"]),
                          snapshot(run("a", 0, 2), run("b", 1, 1)), {})
    last = read_metrics(metrics.path)[-2]
    assert (last["adapter"], last["step"]) == ("a", 2)
    assert last["metrics"]["dynamic_filter/drop_zero_std_0.0"] == 2.0
    assert last["metrics"]["dynamic_filter/drop_zero_std_1.0"] == 0.0
    assert [row.reward for row in progress.rows()] == ["1.000", "0.250"]


async def test_a_reregistration_discards_the_previous_registrations_partial_step(metrics):
    progress = RunProgress(metrics)
    progress.declare(snapshot(run("a", 0, 0, registration_id="r1")))
    half = AdapterRolloutStats(groups=1, rewards=(0.0, 0.0), response_lengths=(9, 9))
    await progress.record(0, batch(0, {"a": half}, []), trained({"a": train_stats(2, 1.0)}, []),
                          snapshot(run("a", 0, 0, registration_id="r1", accumulated=1)), {})
    fresh = AdapterRolloutStats(groups=2, rewards=(1.0,) * 4, response_lengths=(1,) * 4)
    progress.declare(snapshot(run("a", 0, 0, registration_id="r2")))
    await progress.record(1, batch(1, {"a": fresh}, ["a"]), trained({"a": train_stats(4, 1.0)}, ["a"]),
                          snapshot(run("a", 0, 1, registration_id="r2")), {})
    (record,) = [r for r in read_metrics(metrics.path) if r["kind"] == "adapter"]
    assert record["metrics"]["raw_reward_mean"] == 1.0 and record["metrics"]["response_len_max"] == 1.0
    assert record["metrics"]["perf/step_batches"] == 1.0 and record["metrics"]["train_samples"] == 4.0


async def test_live_table_on_a_terminal(metrics):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    clock = Clock()
    stderr = sys.stderr
    terminal_log = logging.StreamHandler(sys.__stderr__)  # what logging.basicConfig installs
    logging.getLogger().addHandler(terminal_log)
    try:
        progress = RunProgress(metrics, view=LiveTableView(console), clock=clock)
        logging.getLogger("miles.test").warning("a log line scrolls above the table")
    finally:
        logging.getLogger().removeHandler(terminal_log)
    progress.declare(snapshot(run("alpha", 0, 0), run("beta", 1, 0, num_step=None)))
    clock.t = 104.0
    stats = AdapterRolloutStats(groups=2, rewards=(1.0, 0.0, 1.0, 1.0), response_lengths=(1,) * 4)
    await progress.record(0, batch(0, {"alpha": stats}, ["alpha"]), trained({"alpha": train_stats(8, 1.0)}, ["alpha"]),
                          snapshot(run("alpha", 0, 1), run("beta", 1, 0, num_step=None)), {"perf/train_time": 0.25})
    progress.declare(MultiLoRASnapshot(active={"beta": run("beta", 1, 0, num_step=None)},
                                       completed=frozenset({"alpha"})))
    progress.close()
    assert sys.stderr is stderr and terminal_log.stream is sys.__stderr__  # redirections undone
    text = out.getvalue()
    assert "a log line scrolls above the table" in text
    final = text[text.rindex("adapter"):]  # the last drawing of the table
    header = final.splitlines()[0]
    assert [c.strip() for c in header.split("┃")][:7] == ["adapter", "kind", "state", "step", "reward", "loss",
                                                            "samples/s"]
    lines = [" ".join(line.replace("│", " ").split()) for line in final.splitlines()]
    # 8 samples over the 4 s since alpha appeared; beta has no end step, no reward, no samples yet.
    assert "alpha server completed 1/3 0.750 1.000 2.0" in lines
    assert "beta server active 0 - - -" in lines
    assert "rollout 0 | alpha: step 1/3 groups=2 reward=0.750 | train=0.25s" in text


async def test_plain_lines_when_not_a_terminal(metrics, caplog):
    caplog.set_level(logging.INFO, logger="miles.main.progress")
    progress = RunProgress(metrics, view=PlainView())
    progress.declare(snapshot(run("alpha", 0, 0)))
    stats = AdapterRolloutStats(groups=2, rewards=(1.0, 0.0, 1.0, 1.0), response_lengths=(1,) * 4)
    await progress.record(0, batch(0, {"alpha": stats}, ["alpha"]), trained({"alpha": train_stats(4, 1.0)}, ["alpha"]),
                          snapshot(run("alpha", 0, 1)), {"perf/generate_time": 1.5, "perf/train_time": 0.25})
    messages = [r.getMessage() for r in caplog.records]
    assert "rollout 0 | alpha: step 1/3 groups=2 reward=0.750 | generate=1.50s train=0.25s" in messages


def test_the_view_follows_the_stream(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(make_view(io.StringIO()), PlainView)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    view = make_view(Terminal())
    try:
        assert isinstance(view, LiveTableView)
    finally:
        view.close()


async def test_a_client_driven_adapter_gets_one_record_per_optim_step(metrics, caplog):
    """Its forward_backward calls since its previous optim_step go into the step's record
    (`loss:sum` summed, as the SDK reduces it), in the same file as the RL adapters' records,
    told apart by `adapter_kind`; its row and line show its step and loss, the controller
    hears its loss, and the summary ends with its checkpoint."""
    caplog.set_level(logging.INFO, logger="miles.main.progress")
    clock = Clock()
    controller = RecordingController()
    progress = RunProgress(metrics, clock=clock, controller=controller)
    model = "s.train.0"
    progress.declare(snapshot(run("rl", 0, 0), clients=(client_run(model, 1, 0),)))

    clock.t = 102.0
    await progress.record_clients([client_report(model, [4.0, 2.0])])  # two calls, no step yet
    assert not [r for r in read_metrics(metrics.path) if r["kind"] == "adapter"]
    clock.t = 104.0
    await progress.record_clients([client_report(model, [3.0], lr=0.02, seconds=0.25)],
                                  {"perf/client_time": 0.5, "perf/snapshot_time": 0.125})
    stats = AdapterRolloutStats(groups=2, rewards=(1.0, 0.0, 1.0, 1.0), response_lengths=(1,) * 4)
    await progress.record(0, batch(0, {"rl": stats}, ["rl"]), trained({"rl": train_stats(4, 1.0)}, ["rl"]),
                          snapshot(run("rl", 0, 1), clients=(client_run(model, 1, 1),)), {})

    records = [r for r in read_metrics(metrics.path) if r["kind"] == "adapter"]
    assert [(r["adapter"], r["adapter_kind"], r["step"]) for r in records] == [(model, "client", 1),
                                                                                ("rl", "server", 1)]
    client = records[0]["metrics"]
    assert client == {
        "loss:sum": 9.0, "forward_backward_calls": 3.0, "train_datums": 6.0, "train_tokens": 18.0,
        "lr": 0.02, "weight_decay": 0.01, "grad_clip_norm": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
        "adam_eps": 1e-12, "grad_norm": 2.5, "perf/train_time": 0.75,
        "perf/samples_per_s": 1.5,  # 6 datums over the 4 s since it appeared, as its row shows
    }
    # The controller hears the client's loss, and the RL adapter's reward, each under its own name.
    assert controller.reports[0] == {model: AdapterGauges(registration_id=f"reg-{model}", raw_reward_mean=None,
                                                          groups_buffered=None, client_loss=9.0)}
    assert set(controller.reports[1]) == {"rl"}
    # Its row: its kind, its step (no end), no reward, its loss, datums/s over the 4 s since it appeared.
    rows = {row.name: row for row in progress.rows()}
    assert (rows[model].kind, rows[model].step, rows[model].reward, rows[model].loss,
            rows[model].samples_per_s) == ("client", "1", "-", "9.000", "1.5")
    assert (rows["rl"].kind, rows["rl"].reward, rows["rl"].loss) == ("server", "0.750", "1.000")
    messages = [r.getMessage() for r in caplog.records]
    assert f"clients | {model}: step 1 loss:sum=9.000 | client=0.50s snapshot=0.12s" in messages

    # The next step's record holds only the calls since this one.
    await progress.record_clients([client_report(model, [1.0], lr=0.01)])
    last = read_metrics(metrics.path)[-1]
    assert (last["adapter"], last["step"]) == (model, 2)
    assert (last["metrics"]["loss:sum"], last["metrics"]["forward_backward_calls"], last["metrics"]["lr"]) == (
        1.0, 1.0, 0.01)
    # A report of another registration of the name is not this one's.
    await progress.record_clients([client_report(model, [7.0], lr=0.01, registration_id="gone")])
    assert read_metrics(metrics.path)[-1]["step"] == 2

    progress.declare(snapshot(run("rl", 0, 1), clients=(client_run(model, 1, 2, resume_from="/ckpt/step-2"),)))
    summary = {row[0]: row for row in progress.summary_rows()}
    assert summary[model] == (model, "client", "-", "-", "9.000", "1.000", "2", "/ckpt/step-2")
    assert summary["rl"][:7] == ("rl", "server", "0.750", "0.750", "1.000", "1.000", "1")


async def test_a_loop_record_carries_the_batch_composition(metrics):
    """`batch`: each adapter's groups and samples in the trained batch (groups of 2 and 3 here),
    in metrics.jsonl only: TensorBoard and W&B get no name holding an adapter's."""
    progress = RunProgress(metrics)
    progress.declare(snapshot(run("a", 0, 0), run("b", 1, 0)))
    samples = [Sample("a", 0, g, i, "p", None, {}, [1]) for g in range(2) for i in range(2)]
    samples += [Sample("b", 1, 0, i, "p", None, {}, [1]) for i in range(3)]
    rollout = RolloutBatch(rollout_id=0, samples=samples, prompt_group_sizes=[2, 2, 3],
                           groups_per_adapter={"a": 2, "b": 1}, step_names=[],
                           per_adapter={"a": AdapterRolloutStats(groups=2), "b": AdapterRolloutStats(groups=1)})
    await progress.record(0, rollout, trained({}, []), snapshot(run("a", 0, 0), run("b", 1, 0)),
                          {"perf/train_time": 0.5})
    (loop,) = [r for r in read_metrics(metrics.path) if r["kind"] == "loop"]
    assert loop["batch"] == {"a": {"groups": 2, "samples": 4}, "b": {"groups": 1, "samples": 3}}
    assert all(k.startswith("perf/") for k in loop["metrics"])  # the scalars TensorBoard and W&B get


def test_client_metrics_reduce_as_their_names_say():
    """As the SDK combines the chunks of one call: sum, min, max, and mean weighted by datums;
    a name with another reduction, or missing from a call, is left out."""
    assert doctest.testmod(client_commands).failed == 0
    calls = [ClientCall({"a:max": 1.0, "b:min": 1.0, "c:unique": 1.0, "d:sum": 1.0}, datums=1, tokens=1),
             ClientCall({"a:max": 3.0, "b:min": -1.0, "c:unique": 2.0}, datums=1, tokens=1)]
    assert reduce_metrics(calls) == {"a:max": 3.0, "b:min": -1.0}
    assert reduce_metrics([]) == {}


def test_the_summary_names_the_checkpoint_the_backend_would_resume_from(metrics):
    """The checkpoint column asks the backend (`TrainingBackend.latest_checkpoint`) about each
    adapter's save directory; "-" where there is none, or without a backend to ask."""
    saved = AdapterRun(name="a", config=AdapterRunConfig(data="unused.jsonl", rollout_batch_size=2,
                                                          n_samples_per_prompt=2, num_step=3, save="/runs/a"),
                       slot=0, version=1, step=0, accumulated_groups=0, registration_id="reg-a")
    checkpoints = {"/runs/a": Path("/runs/a/checkpoints/step_2")}
    progress = RunProgress(metrics, latest_checkpoint=checkpoints.get)
    progress.declare(snapshot(saved, run("b", 1, 0)))
    summary = {row[0]: row[-1] for row in progress.summary_rows()}
    assert summary == {"a": "/runs/a/checkpoints/step_2", "b": "-"}
    without = RunProgress(metrics)
    without.declare(snapshot(saved))
    assert without.summary_rows()[0][-1] == "-"
