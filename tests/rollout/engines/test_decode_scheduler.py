"""The decode loop in-process: continuous batching, aborts, pause, against full forwards."""

from __future__ import annotations

import threading

import pytest
import torch

from miles import lora
from miles.rollout.engines.sampling import RowSampling, filter_logits
from miles.rollout.engines.scheduler import DecodeScheduler, Job, SchedulerConfig
from miles.utils.types import SamplingParams
from tests.helpers.waiting import wait_until


@pytest.fixture(scope="module")
def scheduler(trainer_reference):
    model = trainer_reference.model
    config = SchedulerConfig(max_running_requests=8, max_context=512,
                             eos_token_ids=frozenset([trainer_reference.tokenizer.eos_token_id]))
    sched = DecodeScheduler(model, config, decode=lambda ids: trainer_reference.tokenizer.decode(ids),
                            slot_context=lambda slots: lora.use_slots(model, slots))
    sched.start()
    yield sched
    sched.stop()


def make_job(rid: str, prompt_ids: list[int], slot: int, max_new_tokens: int) -> tuple[Job, threading.Event]:
    done = threading.Event()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    job = Job(rid=rid, prompt_ids=prompt_ids, params=params, slot=slot, lora_name=None,
              sampling=RowSampling.from_params(params, None), on_done=lambda _: done.set())
    return job, done


def test_new_requests_join_a_running_batch(scheduler, trainer_reference):
    encode = trainer_reference.tokenizer.encode
    slots = trainer_reference.slots
    long_job, long_done = make_job("long", encode("The quick brown fox"), slots["ad0"], 200)
    scheduler.submit(long_job)
    wait_until(lambda: len(long_job.output_ids) >= 5, 30, "five tokens of the long request")
    steps_before = scheduler.steps
    joiners = [make_job(f"join{i}", encode(p), s, 6)
               for i, (p, s) in enumerate([("1+2=", slots["ad1"]), ("hi", -1), ("x", slots["ad2"])])]
    for job, _ in joiners:
        scheduler.submit(job)
    for _, done in joiners:
        assert done.wait(30)
        # Joined mid-flight: they finished while the long request was still decoding.
        assert not long_done.is_set()
    assert long_done.wait(60)
    assert scheduler.max_batch_seen >= 4
    # 3 x 6 joining tokens rode along the long request's steps instead of adding their own.
    assert scheduler.steps - steps_before <= 200
    for job, slot_name in [(long_job, "ad0"), (joiners[0][0], "ad1"), (joiners[1][0], None), (joiners[2][0], "ad2")]:
        scored = trainer_reference.score(job.prompt_ids, job.output_ids, slot_name)
        assert job.output_ids == scored.greedy_tokens
        assert job.logprobs == pytest.approx(scored.logprobs, abs=1e-4)


def test_abort_running_and_queued(scheduler, trainer_reference):
    encode = trainer_reference.tokenizer.encode
    running, running_done = make_job("a::1", encode("abc"), -1, 400)
    other, other_done = make_job("b::1", encode("abc"), -1, 10)
    scheduler.submit(running)
    wait_until(lambda: len(running.output_ids) >= 2, 30, "two tokens of the running request")
    scheduler.pause()
    queued, queued_done = make_job("a::2", encode("xyz"), -1, 10)
    scheduler.submit(queued)
    scheduler.submit(other)
    assert scheduler.abort(rid="a::", prefix=True) == 2
    assert queued_done.wait(5) and running_done.wait(5)
    assert queued.finish.type == "abort" and queued.output_ids == []
    assert running.finish.type == "abort" and 2 <= len(running.output_ids) < 400
    # Paused: held, not lost. The aborted request has left the batch and the other one is queued.
    wait_until(lambda: scheduler.counts() == (0, 1), 30, "the aborted request to leave the batch")
    assert not other_done.is_set() and other.output_ids == []
    scheduler.resume()
    assert other_done.wait(30) and other.finish.type == "length" and len(other.output_ids) == 10


def test_top_k_and_top_p_filters():
    logits_V = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits_V, top_k=2, top_p=1.0)).tolist() == [False, False, True, True]
    probs = torch.softmax(logits_V, dim=-1)  # ~[0.64, 0.24, 0.09, 0.03]
    kept = ~torch.isinf(filter_logits(logits_V, top_k=-1, top_p=0.8))
    assert kept.tolist() == [True, True, False, False]
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert (~torch.isinf(filter_logits(logits_V, top_k=-1, top_p=0.1))).tolist() == [True, False, False, False]


def test_eos_stops_unless_ignored(trainer_reference):
    model, tokenizer = trainer_reference.model, trainer_reference.tokenizer
    prompt = tokenizer.encode("hello there")
    probe, probe_done = make_job("probe", prompt, -1, 6)
    plain = DecodeScheduler(model, SchedulerConfig(4, 512, frozenset()), decode=tokenizer.decode,
                            slot_context=lambda slots: lora.use_slots(model, slots))
    plain.start()
    plain.submit(probe)
    assert probe_done.wait(30)
    plain.stop()
    eos = probe.output_ids[2]
    first = probe.output_ids.index(eos)
    with_eos = DecodeScheduler(model, SchedulerConfig(4, 512, frozenset([eos])), decode=tokenizer.decode,
                               slot_context=lambda slots: lora.use_slots(model, slots))
    with_eos.start()
    stopped, stopped_done = make_job("eos", prompt, -1, 6)
    stopped.params = stopped.params.model_copy(update={"ignore_eos": False})
    ignored, ignored_done = make_job("ignore", prompt, -1, 6)
    with_eos.submit(stopped, ignored)
    assert stopped_done.wait(30) and ignored_done.wait(30)
    with_eos.stop()
    assert stopped.output_ids == probe.output_ids[: first + 1]
    assert stopped.finish.type == "stop" and stopped.finish.matched == eos
    assert ignored.output_ids == probe.output_ids and ignored.finish.type == "length"
