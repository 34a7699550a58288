"""The Tinker gateway without HTTP: sessions and their expiry, models, translation of bodies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles.controller.backend import MultiLoRABackend
from miles.controller.store import RegistryStore
from miles.controller.tinker.errors import GatewayError, GatewayNotFoundError, GatewaySessionFinishedError
from miles.controller.tinker.gateway import GatewayConfig, TinkerGateway
from miles.controller.tinker.models import LoraLayout, model_name
from miles.controller.tinker.proto import DTYPE_FLOAT32, DTYPE_INT64, WireDatum, WireForwardBackward, WireTensor
from miles.controller.tinker.routes import forward_command
from miles.controller.tinker.sessions import SessionInfo
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import AdapterState, ClientCommandKind, ClientCommandStatus, ClientLoss, WeightsResult
from miles.utils.types.lifecycle_ops import ActivateClients, RequeueForNewTrainer

LAYOUT = LoraLayout(rank=4, train_unembed=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gateway(defaults: AdapterDefaults, clock: Clock) -> TinkerGateway:
    backend = MultiLoRABackend(2, defaults)
    return TinkerGateway(backend, GatewayConfig(base_model="/models/tiny-base", session_timeout_s=60), clock=clock)


def test_a_silent_session_is_finished_and_its_models_unloaded(gateway: TinkerGateway, clock: Clock) -> None:
    quiet = gateway.sessions.create(SessionInfo())
    alive = gateway.sessions.create(SessionInfo())
    quiet_model = gateway.create_model(quiet, 0, "tiny-base", LAYOUT, {}).model_id
    alive_model = gateway.create_model(alive, 0, "/models/tiny-base", LAYOUT, {}).model_id
    assert quiet_model is not None and alive_model is not None
    clock.now += 50
    gateway.sessions.heartbeat(alive)
    clock.now += 20  # quiet: 70 s without a heartbeat; alive: 20 s
    assert gateway.take_commands().empty
    assert gateway.sessions.get(quiet).finished and not gateway.sessions.get(alive).finished
    assert gateway.models.state(quiet_model) is AdapterState.RETIRING
    assert gateway.models.state(alive_model) is AdapterState.PENDING
    assert gateway.expire_sessions() == []  # finished once
    with pytest.raises(GatewaySessionFinishedError, match="is finished"):
        gateway.sessions.heartbeat(quiet)  # 410: the SDK stops its heartbeat loop
    with pytest.raises(GatewayError, match="is finished"):
        gateway.create_model(quiet, 1, "tiny-base", LAYOUT, {})


def test_create_model_is_idempotent_and_names_the_adapter_after_the_model(gateway: TinkerGateway) -> None:
    session = gateway.sessions.create(SessionInfo(tags=["t"], user_metadata={"who": "me"}))
    first = gateway.create_model(session, 0, "tiny-base", LAYOUT, {"run": "a"})
    assert gateway.create_model(session, 0, "tiny-base", LAYOUT, {}) == first
    assert first.model_id == f"{session}:train:0" and first.model == f"{session}.train.0"
    name, config = gateway.models.get(first.model_id)
    assert (name, config.rank, config.alpha, config.user_metadata) == (first.model, 4, 16.0, {"run": "a"})
    assert str(config.save).endswith(f"save/adapters/{session}.train.0")
    assert gateway.sessions.get(session).model_ids == [first.model_id]
    with pytest.raises(GatewayError, match="Unknown session"):
        gateway.create_model("s-nope", 0, "tiny-base", LAYOUT, {})
    with pytest.raises(GatewayError, match="lora_config is required"):
        gateway.create_model(session, 1, "tiny-base", None, {})


def test_bad_bodies_of_a_known_call_fail_its_future_and_keep_the_order(gateway: TinkerGateway) -> None:
    session = gateway.sessions.create(SessionInfo())
    model_id = gateway.create_model(session, 0, "tiny-base", LAYOUT, {}).model_id
    assert model_id is not None
    bad = gateway.submit(model_id, 1, ClientCommandKind.SAVE_STATE,
                         lambda: gateway.saves.save_state_command(model_id, "../escape", overwrite=False))
    assert bad.status is ClientCommandStatus.FAILED and "checkpoint name '../escape'" in (bad.error or "")
    good = gateway.submit(model_id, 2, ClientCommandKind.SAVE_STATE,
                          lambda: gateway.saves.save_state_command(model_id, "ok", overwrite=False))
    (model,) = gateway.take_commands().models
    assert model.barrier is not None and model.barrier.future_id == good.future_id
    with pytest.raises(GatewayError, match="seq_id is required"):
        gateway.submit(model_id, None, ClientCommandKind.SAVE_STATE, lambda: pytest.fail("not built"))
    with pytest.raises(GatewayError, match="Unknown model"):
        gateway.submit("s-x:train:0", 1, ClientCommandKind.SAVE_STATE, lambda: pytest.fail("not built"))


def wire(**inputs: WireTensor) -> WireForwardBackward:
    return WireForwardBackward(model_id="m", seq_id=1, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8},
                               data=[WireDatum(tokens=[1, 2, 3], loss_fn_inputs=inputs)])


def test_forward_bodies_translate_into_typed_datums_or_are_refused_by_name() -> None:
    targets = WireTensor(values=[2, 3, 4], shape=[3], dtype=DTYPE_INT64)
    advantages = WireTensor(values=[0.5, -0.5, 1.0], shape=[3], dtype=DTYPE_FLOAT32)
    command = forward_command(wire(target_tokens=targets, advantages=advantages))
    assert command.loss == ClientLoss("ppo", {"clip_low_threshold": 0.8})
    (datum,) = command.datums
    assert datum.tokens == [1, 2, 3] and datum.inputs == {"target_tokens": [2, 3, 4], "advantages": [0.5, -0.5, 1.0]}
    refusals = [
        (wire(advantages=advantages), r"data\[0\].loss_fn_inputs needs target_tokens"),
        (wire(target_tokens=WireTensor(values=[2, 3], shape=[2], dtype=DTYPE_INT64)),
         r"loss_fn_inputs\['target_tokens'\] has shape \[2\]; give one value per input token \(3\)"),
        (wire(target_tokens=WireTensor(values=[1] * 6, shape=[3, 2], dtype=DTYPE_INT64)), r"has shape \[3, 2\]"),
        (WireForwardBackward(model_id="m", seq_id=1, loss_fn="cross_entropy"), "at least one datum"),
    ]
    for body, message in refusals:
        with pytest.raises(GatewayError, match=message):
            forward_command(body)
    text_config = wire(target_tokens=targets)
    text_config.loss_fn_config = {"mode": "fast"}
    with pytest.raises(GatewayError, match=r"loss_fn_config \['mode'\]: only numbers"):
        forward_command(text_config)


def test_a_trainer_without_save_cannot_host_models(defaults: AdapterDefaults, tmp_path: Path) -> None:
    import dataclasses

    backend = MultiLoRABackend(1, dataclasses.replace(defaults, save=None))
    gateway = TinkerGateway(backend, GatewayConfig())
    session = gateway.sessions.create(SessionInfo())
    with pytest.raises(GatewayError, match="no --save directory"):
        gateway.create_model(session, 0, "any-base", LAYOUT, {})


def test_the_trainer_flags_name_the_served_base_model_and_layout(tmp_path: Path) -> None:
    from miles.controller.actor import ControllerConfig
    from miles.utils.arguments import parse_args

    cfg = parse_args(["--multi-lora-n-adapters", "2", "--hf-checkpoint", "/models/Qwen3-0.6B",
                      "--save", str(tmp_path), "--lora-rank", "8", "--target-modules", "q_proj,v_proj"])
    config = ControllerConfig.from_config(cfg).gateway
    assert (config.base_model, config.tokenizer_id, config.target_modules) == (
        "/models/Qwen3-0.6B", "/models/Qwen3-0.6B", "q_proj,v_proj")
    gateway = TinkerGateway(MultiLoRABackend(2, AdapterDefaults.from_config(cfg)), config)
    session = gateway.sessions.create(SessionInfo())
    with pytest.raises(GatewayError, match="slots cover only --target-modules 'q_proj,v_proj'"):
        gateway.create_model(session, 0, "Qwen3-0.6B", LAYOUT, {})  # the name alone is the served model
    with pytest.raises(GatewayError, match="'Qwen3-8B' is not served here"):
        gateway.create_model(session, 0, "Qwen3-8B", LAYOUT, {})


def test_sampling_sessions_name_written_snapshots_only_and_survive_a_restart(defaults: AdapterDefaults,
                                                                            tmp_path: Path) -> None:
    store = RegistryStore(tmp_path / "registry.sqlite")
    gateway = TinkerGateway(MultiLoRABackend(2, defaults, store=store), GatewayConfig(base_model="/m/tiny-base"),
                            store)
    session = gateway.sessions.create(SessionInfo())
    model_id = gateway.create_model(session, 0, "tiny-base", LAYOUT, {}).model_id
    assert model_id is not None
    path = f"tinker://{model_id}/sampler_weights/s1"
    save = gateway.submit(model_id, 1, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                          lambda: gateway.saves.sampler_command(model_id, "s1"))
    with pytest.raises(GatewayNotFoundError, match=f"{re.escape(path)}.*not written yet"):
        gateway.samplers.create(session, 0, path, None)
    (taken,) = gateway.take_commands().commands
    assert taken.future_id == save.future_id
    with pytest.raises(GatewayNotFoundError, match="not written yet"):
        gateway.samplers.snapshot(path)  # RUNNING: the driver is writing it
    gateway.complete(taken.future_id, WeightsResult())
    snapshot = gateway.samplers.snapshot(path)
    assert (snapshot.model_id, snapshot.name, snapshot.tinker_path) == (model_id, "s1", path)
    assert snapshot.directory.endswith(f"adapters/{model_name(model_id)}/sampler_weights/s1")

    again = gateway.submit(model_id, 2, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                           lambda: gateway.saves.sampler_command(model_id, "s1"))
    assert again.status is ClientCommandStatus.FAILED and "immutable" in (again.error or "")
    broken = gateway.submit(model_id, 3, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                            lambda: gateway.saves.sampler_command(model_id, "broken"))
    (taken,) = gateway.take_commands().commands
    gateway.fail(taken.future_id, "disk full")
    with pytest.raises(GatewayNotFoundError, match="save_weights_for_sampler failed"):
        gateway.samplers.snapshot(f"tinker://{model_id}/sampler_weights/broken")
    with pytest.raises(GatewayNotFoundError, match="never ran save_weights_for_sampler"):
        gateway.samplers.snapshot(f"tinker://{model_id}/sampler_weights/other")
    with pytest.raises(GatewayError, match="not a sampler snapshot path"):
        gateway.samplers.snapshot(f"tinker://{model_id}/weights/s1")

    sampler = gateway.samplers.create(session, 0, path, None)
    assert gateway.samplers.create(session, 0, None, "tiny-base") == sampler  # a retry: the same session
    assert (sampler.sampler_id, sampler.base_model, sampler.model_path) == (f"{session}:sample:0", "tiny-base", path)
    base = gateway.samplers.create(session, 1, None, "/m/tiny-base")
    assert base.model_path is None
    with pytest.raises(GatewayError, match="'other' is not served here"):
        gateway.samplers.create(session, 2, None, "other")
    unnamed = gateway.submit(model_id, 4, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                             lambda: gateway.saves.sampler_command(model_id, None, 4))
    made = gateway.samplers.create_for_save(model_id, 2, unnamed)
    assert made.model_path == f"tinker://{model_id}/sampler_weights/sampler-seq-4"
    assert gateway.samplers.made_by_save(unnamed.future_id) == made
    assert gateway.samplers.made_by_save(broken.future_id) is None
    store.close()

    store = RegistryStore(tmp_path / "registry.sqlite")
    restarted = TinkerGateway(MultiLoRABackend(2, defaults, store=store), GatewayConfig(base_model="/m/tiny-base"),
                              store)
    samplers = restarted.sessions.get(session).samplers
    assert [s.sampler_id for s in samplers] == [f"{session}:sample:{i}" for i in range(3)]
    assert restarted.samplers.get(sampler.sampler_id) == sampler and restarted.samplers.snapshot(path) == snapshot
    assert restarted.samplers.made_by_save(unnamed.future_id) == made
    with pytest.raises(GatewayNotFoundError, match="Unknown sampling session"):
        restarted.samplers.get(f"{session}:sample:9")
    store.close()


def test_layouts_are_part_of_the_model_and_survive_a_restart(defaults: AdapterDefaults, tmp_path: Path) -> None:
    from miles.backends.base import AdapterSpec
    from miles.utils.types.client_commands import LoraGroup

    store = RegistryStore(tmp_path / "registry.sqlite")
    gateway = TinkerGateway(MultiLoRABackend(3, defaults, store=store), GatewayConfig(base_model="/m/tiny-base"),
                            store)
    session = gateway.sessions.create(SessionInfo())
    no_attn = gateway.create_model(session, 0, "tiny-base", LoraLayout(rank=4, train_attn=False,
                                                                       train_unembed=False), {}).model_id
    mlp_off = gateway.create_model(session, 1, "tiny-base", LoraLayout(rank=2, train_mlp=False,
                                                                       train_unembed=False), {}).model_id
    with pytest.raises(GatewayError, match="train_unembed=True needs .*restart it with --lora-unembed"):
        gateway.create_model(session, 2, "tiny-base", LoraLayout(rank=4), {})  # the SDK's default
    with pytest.raises(GatewayError, match="trains nothing"):
        gateway.create_model(session, 2, "tiny-base", LoraLayout(rank=4, train_attn=False, train_mlp=False,
                                                                 train_unembed=False), {})
    assert no_attn is not None and mlp_off is not None
    store.close()

    store = RegistryStore(tmp_path / "registry.sqlite")
    backend = MultiLoRABackend(3, defaults, store=store)
    restarted = TinkerGateway(backend, GatewayConfig(base_model="/m/tiny-base", lora_unembed=True), store)
    _, config = restarted.models.get(no_attn)
    assert (config.train_attn, config.train_mlp, config.train_unembed) == (False, True, False)
    assert restarted.models.get(mlp_off)[1].frozen_groups() == {LoraGroup.MLP, LoraGroup.UNEMBED}
    runs = backend.snapshot().clients
    assert AdapterSpec.for_client(runs[model_name(no_attn)]).frozen == {LoraGroup.ATTN, LoraGroup.UNEMBED}
    status = {s.model_id: s for s in backend.statuses()}[no_attn]
    assert (status.train_attn, status.train_mlp, status.train_unembed) == (False, True, False)
    # With lm_head LoRA in the slots, the SDK's default layout trains it too.
    head = restarted.create_model(session, 2, "tiny-base", LoraLayout(rank=4), {}).model_id
    assert head is not None and restarted.models.get(head)[1].frozen_groups() == frozenset()
    store.close()


def test_a_paged_model_stays_paged_over_a_restart_and_its_next_command_pages_it_in(
        defaults: AdapterDefaults, clock: Clock, tmp_path: Path) -> None:
    """The page-out is written through to the registry's store: a controller restarted over it
    (as after a SIGKILL of the whole trainer) knows the model PAGED, and its next command puts it
    in a slot to be loaded from where it was paged out to."""
    from miles.utils.types import AdamStep, OptimStepCommand, OptimStepResult

    store = RegistryStore(tmp_path / "registry.sqlite")
    gateway = TinkerGateway(MultiLoRABackend(1, defaults, store=store), GatewayConfig(base_model="/m/tiny-base"),
                            store, clock=clock)
    session = gateway.sessions.create(SessionInfo())
    created = gateway.create_model(session, 0, "tiny-base", LAYOUT, {})
    model, model_id = created.model, created.model_id
    assert model is not None and model_id is not None
    gateway.backend.apply_now(ActivateClients([model]))
    step = gateway.submit(model_id, 1, ClientCommandKind.OPTIM_STEP,
                          lambda: OptimStepCommand(AdamStep(learning_rate=0.1)))
    clock.now += 30
    assert gateway.idle_models(10) == []  # a command in flight (logged, not taken)
    gateway.take_commands()
    assert gateway.idle_models(10) == []  # running
    clock.now += 30
    assert gateway.idle_models(10) == []  # running: its future is not completed
    gateway.complete(step.future_id, OptimStepResult({}))
    assert gateway.idle_models(10) == []  # it just finished
    clock.now += 10
    assert gateway.idle_models(10) == [model]
    paged_dir = str(tmp_path / "paged")
    assert gateway.page_out(model, paged_dir) and gateway.paging.paged_count() == 1
    assert not gateway.page_out(model, paged_dir)  # PAGED already
    store.close()

    store = RegistryStore(tmp_path / "registry.sqlite")
    backend = MultiLoRABackend(1, defaults, store=store)
    backend.apply_now(RequeueForNewTrainer())
    restarted = TinkerGateway(backend, GatewayConfig(base_model="/m/tiny-base"), store, clock=clock)
    assert restarted.models.state(model_id) is AdapterState.PAGED and backend.registry.free_slots == [0]
    assert restarted.idle_models(0) == []  # only a model in a slot pages out
    restarted.submit(model_id, 2, ClientCommandKind.OPTIM_STEP, lambda: OptimStepCommand(AdamStep(learning_rate=0.1)))
    run = backend.snapshot().clients[model]
    assert (run.state, run.slot, run.step, run.resume_from, run.resume_step) == (
        AdapterState.PENDING, 0, 1, paged_dir, 1)
    restarted.unload_model(model_id)
    assert restarted.models.state(model_id) is AdapterState.RETIRING
