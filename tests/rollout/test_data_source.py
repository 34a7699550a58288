"""Per-adapter prompt streams: background loading, seeded epochs, data positions that
resume a stream exactly, chat templates, merged metadata, and isolation of a broken
dataset. (Reading and checking the files themselves: test_datasets.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from miles.recipes.tiny_model import build_char_tokenizer
from miles.rollout.data_source import AdapterDataset, DatasetCheck, DataSourceConfig, MultiLoRADataSource
from miles.rollout.rewards import get_reward_fn
from miles.utils.arguments import parse_args
from miles.utils.types import DataPosition, MultiLoRASnapshot
from tests.helpers.rollout_fakes import make_run
from tests.helpers.waiting import wait_until_async

ROWS = [{"text": f"q{i}", "label": i, "metadata": {"k": i, "shared": "row"}} for i in range(5)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    return {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}


def data_source(*, seed=1, chat=False, shuffle=True, max_prompt_len=None):
    tokenizer = build_char_tokenizer()
    config = DataSourceConfig(seed=seed, apply_chat_template=chat, default_rm_type="exact", shuffle=shuffle,
                              max_prompt_len=max_prompt_len)
    return MultiLoRADataSource(config, tokenizer), tokenizer


async def wait_ready(source, runs):
    """Datasets load in the background; one that failed to load fails the wait at once."""

    def loaded() -> bool:
        failed = {r.name: source.failed[r.registration_id] for r in runs if r.registration_id in source.failed}
        assert not failed, f"datasets failed to load: {failed}"
        return all(source.ready(r) for r in runs)

    await wait_until_async(loaded, 10, f"the datasets of {[r.name for r in runs]} to load")


async def test_samples_carry_adapter_label_merged_metadata_and_reward(files):
    run = make_run("a", 3, data=files["jsonl"], input_key="text", label_key="label", metadata_key="metadata",
                   metadata={"shared": "adapter", "task": "t"}, rm_type="math")
    source, tokenizer = data_source()
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    item = source.next_prompt(run)
    i = int(item.prompt[1:])
    assert (item.adapter, item.slot, item.group_index, item.label) == ("a", 3, 0, str(i))
    assert item.metadata == {"shared": "row", "task": "t", "k": i}
    assert item.prompt_ids == tokenizer.encode(f"q{i}")
    samples = item.new_samples(2)
    assert [(s.adapter, s.slot, s.index, s.group_index) for s in samples] == [("a", 3, 0, 0), ("a", 3, 1, 0)]
    assert item.reward.resolve(samples[0]) is get_reward_fn("math")


async def test_epochs_wrap_in_a_seeded_order(files):
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    orders = []
    for _ in range(2):
        source, _ = data_source(seed=7)
        source.sync(MultiLoRASnapshot(active={"a": run}))
        await wait_ready(source, [run])
        orders.append([source.next_prompt(run) for _ in range(15)])
    prompts = [item.prompt for item in orders[0]]
    for epoch in range(3):
        assert sorted(prompts[5 * epoch: 5 * epoch + 5]) == [f"q{i}" for i in range(5)]
    assert [item.group_index for item in orders[0]] == list(range(15))
    assert prompts == [item.prompt for item in orders[1]]  # same seed and name, same order
    assert prompts[:5] != prompts[5:10] or prompts[5:10] != prompts[10:15]  # reshuffled per epoch


async def test_chat_messages_get_the_template(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "2+2?"}], "label": "4"}])
    run = make_run("a", 0, data=path, input_key="messages", label_key="label")
    source, tokenizer = data_source()
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    item = source.next_prompt(run)
    assert item.prompt == "user: 2+2?\nassistant: "
    assert item.prompt_ids == tokenizer.encode(item.prompt, add_special_tokens=False)


async def test_broken_dataset_disables_only_its_adapter(tmp_path, files):
    good = make_run("good", 0, data=files["jsonl"], input_key="text", label_key="label")
    bad = make_run("bad", 1, data=str(tmp_path / "gone.jsonl"), input_key="text", label_key="label")
    source, _ = data_source()
    source.sync(MultiLoRASnapshot(active={"good": good, "bad": bad}))
    await wait_ready(source, [good])
    await wait_until_async(lambda: bad.registration_id in source.failed, 10, "the broken dataset to fail")
    assert "no such file" in source.failed[bad.registration_id]
    assert not source.ready(bad)
    source.sync(MultiLoRASnapshot(active={"good": good, "bad": bad}))  # no retry loop on the same registration
    assert not source.ready(bad)


async def test_reregistration_reloads_and_retired_adapters_are_forgotten(tmp_path, files):
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    source, _ = data_source()
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    source.sync(MultiLoRASnapshot())
    assert not source.ready(run)
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "x", "label": "y"}])
    again = dataclasses.replace(make_run("a", 2, data=other, input_key="text", label_key="label"),
                                registration_id="second")
    source.sync(MultiLoRASnapshot(pending={"a": again}))
    await wait_ready(source, [again])
    assert source.next_prompt(again).prompt == "x"
    assert source.positions() == {"a": DataPosition(epoch=1, index=0)}  # the new file has one row
    await source.close()


def test_an_epochs_order_depends_only_on_seed_and_epoch():
    rows = [{"i": i} for i in range(7)]
    one, other = AdapterDataset(rows, "1:a"), AdapterDataset(rows, "1:a")
    stream = [one.next_row()[1]["i"] for _ in range(3 * 7)]
    other.seek(DataPosition(epoch=2, index=0))  # straight to epoch 2, no epochs 0 and 1 drawn
    assert [other.next_row()[1]["i"] for _ in range(7)] == stream[14:]
    assert AdapterDataset(rows, "1:b")._epoch_order(0) != one._epoch_order(0)  # per adapter
    assert one._epoch_order(0) != one._epoch_order(1)


@pytest.mark.parametrize("consumed", [0, 3, 5, 12])
async def test_restored_position_continues_exactly_where_the_stream_stopped(files, consumed):
    """Consume k prompts, take the position, build a fresh data source (as after a
    restart), restore: the next prompts are those an uninterrupted source gives."""
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    snapshot = MultiLoRASnapshot(active={"a": run})
    uninterrupted, _ = data_source(seed=3)
    uninterrupted.sync(snapshot)
    await wait_ready(uninterrupted, [run])
    expected = [uninterrupted.next_prompt(run) for _ in range(consumed + 8)]

    first, _ = data_source(seed=3)
    first.sync(snapshot)
    await wait_ready(first, [run])
    for _ in range(consumed):
        first.next_prompt(run)
    position = first.positions()["a"]
    assert position == DataPosition(epoch=consumed // 5, index=consumed % 5)
    saved = json.loads(json.dumps(position.to_dict()))  # as trainer_state.json holds it
    await first.close()

    resumed, _ = data_source(seed=3)
    resumed.restore("a", run.registration_id, DataPosition.from_dict(saved))  # before the dataset loads
    assert resumed.positions() == {"a": position}
    resumed.sync(MultiLoRASnapshot(pending={"a": run}))  # registered, not sampleable yet
    await wait_ready(resumed, [run])
    resumed.sync(snapshot)
    got = [resumed.next_prompt(run) for _ in range(8)]
    assert [(i.prompt, i.label, i.group_index) for i in got] == \
        [(i.prompt, i.label, i.group_index) for i in expected[consumed:]]


async def test_restore_after_the_dataset_loaded_and_for_another_registration(files):
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    source, _ = data_source(seed=3)
    source.sync(MultiLoRASnapshot(pending={"a": run}))
    await wait_ready(source, [run])
    source.restore("a", "some-other-registration", DataPosition(epoch=4, index=1))
    assert source.positions()["a"] == DataPosition(epoch=0, index=0)  # not this registration's
    source.restore("a", run.registration_id, DataPosition(epoch=1, index=4))
    assert source.positions()["a"] == DataPosition(epoch=1, index=4)
    item = source.next_prompt(run)
    assert item.group_index == 9
    assert source.positions()["a"] == DataPosition(epoch=2, index=0)


async def test_position_of_an_adapter_that_left_is_kept_until_its_name_is_registered_again(files):
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    source, _ = data_source()
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    for _ in range(2):
        source.next_prompt(run)
    source.sync(MultiLoRASnapshot())  # retired: its final save still asks where it stopped
    assert source.positions() == {"a": DataPosition(epoch=0, index=2)}
    again = dataclasses.replace(run, registration_id="second")
    source.sync(MultiLoRASnapshot(pending={"a": again}))
    assert source.positions() == {}  # the old registration's position is not the new one's
    await wait_ready(source, [again])
    assert source.positions() == {"a": DataPosition(epoch=0, index=0)}
    await source.close()


def test_data_position_round_trips_and_rejects_bad_input():
    assert DataPosition.from_dict(DataPosition(3, 7).to_dict()) == DataPosition(epoch=3, index=7)
    for bad in ({"epoch": 1}, {"epoch": "1", "index": 0}, {"epoch": 1, "index": True}, [1, 2],
                {"epoch": 0, "index": 0, "row": 1}):
        with pytest.raises(ValueError, match="a data position is"):
            DataPosition.from_dict(bad)
    with pytest.raises(ValueError, match="epoch >= 0"):
        DataPosition(epoch=-1, index=0)


async def test_a_restored_position_survives_a_deregistration_before_the_first_prompt(files):
    """PENDING, restored, then gone before it was ever sampled: its final save still
    gets the restored position, not a fresh start."""
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    source, _ = data_source()
    source.restore("a", run.registration_id, DataPosition(epoch=2, index=3))
    source.sync(MultiLoRASnapshot(pending={"a": run}))
    await wait_ready(source, [run])
    source.sync(MultiLoRASnapshot())
    assert source.positions() == {"a": DataPosition(epoch=2, index=3)}


async def test_without_rollout_shuffle_every_epoch_is_in_file_order(files):
    run = make_run("a", 0, data=files["jsonl"], input_key="text", label_key="label")
    source, _ = data_source(shuffle=False)
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    assert [source.next_prompt(run).prompt for _ in range(12)] == [f"q{i % 5}" for i in range(12)]
    await source.close()


def test_data_flags_reach_the_data_source():
    config = DataSourceConfig.from_config(parse_args(["--rollout-shuffle", "--rollout-seed", "3",
                                                      "--rollout-max-prompt-len", "9", "--apply-chat-template"]))
    assert (config.shuffle, config.seed, config.max_prompt_len, config.apply_chat_template) == (True, 3, 9, True)
    assert DataSourceConfig.from_config(parse_args([])).shuffle is False  # Miles' default: file order


LONG_ROWS = [{"text": "x" * n, "label": n} for n in (2, 7, 3, 9, 4)]


async def test_prompts_over_the_max_prompt_len_are_never_drawn(tmp_path):
    run = make_run("a", 0, data=write_jsonl(tmp_path / "long.jsonl", LONG_ROWS), input_key="text", label_key="label")
    source, _ = data_source(shuffle=False, max_prompt_len=4)
    source.sync(MultiLoRASnapshot(active={"a": run}))
    await wait_ready(source, [run])
    assert [source.next_prompt(run).label for _ in range(6)] == ["2", "3", "4", "2", "3", "4"]
    await source.close()


@pytest.mark.parametrize("max_len, rows", [(None, 5), (9, 5), (4, 3), (2, 1)])
def test_registration_counts_the_rows_that_fit_so_num_step_is_derived_after_the_filter(tmp_path, max_len, rows):
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    path = write_jsonl(tmp_path / "long.jsonl", LONG_ROWS)
    check = DatasetCheck(tokenizer_path=str(tokenizer_dir), max_prompt_len=max_len)
    assert check(path, "text", "label") == rows


def test_registration_refuses_a_dataset_with_no_prompt_that_fits(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    check = DatasetCheck(tokenizer_path=str(tokenizer_dir), max_prompt_len=1)
    with pytest.raises(ValueError, match="every prompt is longer than --rollout-max-prompt-len 1"):
        check(write_jsonl(tmp_path / "long.jsonl", LONG_ROWS), "text", "label")
