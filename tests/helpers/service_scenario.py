"""The service scenario of the end-to-end trainer tests, for each training backend.

    write_scenario_data(workdir)
    run_service_lifecycle(model_dir, workdir, extra_flags=["--train-backend", "megatron", ...])

`python -m miles.main.train_multi_lora_async` runs as a subprocess on a tiny model, driven
over the control plane's HTTP API; its checkpoints are checked in PEFT
(`assert_peft_computes_the_trainers_logprobs`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from miles.backends.common.checkpoint import latest_checkpoint, read_checkpoint
from miles.controller.client import ControlPlaneClient
from miles.utils.types import AdapterState
from tests.helpers.driver_harness import DriverProcess, tiny_run_flags, write_arithmetic_dataset

TRAINER = "miles.main.train_multi_lora_async"


PEFT_ATOL = 1e-5
"""|logprob(PEFT) - logprob(ours)| in fp32, as in tests/lora/test_lora_peft_io.py and the
torch actor's resume test."""


def assert_peft_computes_the_trainers_logprobs(model_dir: Path, checkpoint: Path) -> None:
    """The checkpoint the trainer wrote, loaded by PEFT as is, gives the logprobs the trainer's
    own model gives with that checkpoint in one of its slots: two implementations of the
    same adapter (PEFT's LoRA layers, our slot page table) agree on the trainer's output,
    and the adapter moves them from the base by far more than that tolerance."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.lora import inject_multi_lora, load_peft_adapter, use_slots

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer("12+34=46", add_special_tokens=False)["input_ids"]])
    rank = json.loads((checkpoint / "adapter_config.json").read_text())["r"]
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inject_multi_lora(ours, n_slots=2, max_rank=rank, target_modules="all-linear")  # the trainer's default
    load_peft_adapter(ours, 1, checkpoint)
    with torch.no_grad():
        with use_slots(ours, [1]):
            trainer = torch.log_softmax(ours(input_ids=ids).logits, dim=-1)
        with use_slots(ours, [-1]):
            base = torch.log_softmax(ours(input_ids=ids).logits, dim=-1)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                               str(checkpoint)).eval()
        peft = torch.log_softmax(peft_model(input_ids=ids).logits, dim=-1)
    torch.testing.assert_close(peft, trainer, atol=PEFT_ATOL, rtol=0)
    moved = float((peft - base).abs().max())
    assert moved > 100 * PEFT_ATOL, f"the trained adapter moves the logprobs by only {moved:.1e}"


def write_scenario_data(workdir: Path) -> None:
    """`workdir/data/add.jsonl` and `sub.jsonl`: 400 sums and 400 differences, seeded."""
    data = workdir / "data"
    data.mkdir()
    write_arithmetic_dataset(data / "add.jsonl", 400, op="+", seed=1)
    write_arithmetic_dataset(data / "sub.jsonl", 400, op="-", seed=2)


def run_service_lifecycle(model_dir: Path, workdir: Path, extra_flags: Sequence[str] = ()) -> None:
    """Adapters register, train (one to its num_step), join, leave and resume from their
    checkpoints over HTTP; the trainer (`tiny_run_flags` plus `extra_flags`, its log in
    `workdir/trainer.log`) stops at SIGTERM with the adapter still training saved.
    `workdir` holds the datasets of `write_scenario_data`."""
    save = workdir / "save"
    flags = tiny_run_flags(model_dir, save, n_adapters=2) + list(extra_flags)
    driver = DriverProcess(TRAINER, flags, workdir / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        client = ControlPlaneClient(url)
        assert client.list() == []
        add = str(workdir / "data" / "add.jsonl")
        sub = str(workdir / "data" / "sub.jsonl")

        # An adapter with num_step trains that many steps and retires by itself.
        # 4 samples per prompt: random 0/1 rewards that tie in every group (zero advantage,
        # no update) become vanishingly unlikely.
        client.register("auto", config={"data": add, "num_step": 2, "n_samples_per_prompt": 4})
        client.wait_for_state("auto", AdapterState.COMPLETED, timeout=240)
        auto = client.status("auto")
        assert auto.step == 2 and auto.version is None
        checkpoint = latest_checkpoint(auto.save)
        assert checkpoint is not None and checkpoint.name == "step_2"
        assert_peft_computes_the_trainers_logprobs(model_dir, checkpoint)
        # It records how far into its dataset it got: at least the prompts it trained on.
        position = read_checkpoint(checkpoint).trainer_state.data_position
        assert position is not None and position.index >= 2 * 2

        # `a` trains; `b` joins while `a` trains, without a restart.
        client.register("a", config={"data": add})
        driver.wait_until(lambda: client.status("a").step >= 1, 240, "a to step")
        client.register("b", config={"data": sub})
        step_a_before_b = client.status("a").step
        driver.wait_until(lambda: client.status("b").step >= 1, 240, "b to step")
        driver.wait_until(lambda: client.status("a").step > step_a_before_b, 240, "a to keep stepping")

        # DELETE a while b keeps training: a is retired, cleaned up, its slot freed.
        first_registration = client.status("a").registration_id
        client.deregister("a")
        client.wait_for_state("a", AdapterState.COMPLETED, timeout=240)
        a_done = client.status("a")
        assert latest_checkpoint(a_done.save) is not None
        step_b = client.status("b").step
        driver.wait_until(lambda: client.status("b").step > step_b, 240, "b to keep stepping after a left")

        # Re-registering a takes the freed slot (2 slots: b + a) and resumes from its checkpoint.
        client.register("a", config={"data": add})
        driver.wait_until(lambda: client.status("a").state is AdapterState.ACTIVE, 240, "a to be active again")
        again = client.status("a")
        assert again.registration_id != first_registration
        assert again.step >= a_done.step
        assert f"Adapter 'a' resumed from {latest_checkpoint(a_done.save)} (step {a_done.step})" in \
            driver.log_path.read_text(), "re-registered adapter did not resume from its last checkpoint"

        # Both leave: idle again with no leaked slot (two fresh adapters fit again).
        client.deregister("b")
        client.deregister("a")
        client.wait_for_state("a", AdapterState.COMPLETED, timeout=240)
        client.wait_for_state("b", AdapterState.COMPLETED, timeout=240)
        assert all(s.state is AdapterState.COMPLETED for s in client.list())
        client.register("c1", config={"data": add, "num_step": 1})
        client.register("c2", config={"data": sub})
        client.wait_for_state("c1", AdapterState.COMPLETED, timeout=240)

        # SIGTERM mid-training: exit 0 with the still-training adapter saved at its step.
        driver.wait_until(lambda: client.status("c2").step >= 1, 240, "c2 to step")
        assert driver.terminate() == 0, driver.log_tail()
        saved = latest_checkpoint(workdir / "save" / "adapters" / "c2")
        assert saved is not None and int(saved.name.removeprefix("step_")) >= 1
    finally:
        driver.kill()
