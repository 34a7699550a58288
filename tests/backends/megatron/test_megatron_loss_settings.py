"""Per-adapter loss settings in the Megatron backend equal the torch backend's: an entropy
bonus with a KL loss term, and reinforce++ whose `--kl-coef` shapes the token rewards with
the rank's `reward_kl` (policy vs slot off). One Megatron rank (TP 1, a spawned gloo
process) and one torch rank play the same script on the same tiny model, in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from miles.backends.common.loss import adapter_token_advantages
from miles.utils.loss_settings import LossSettings
from tests.helpers.megatron_scenario import RANK, random_adapter
from tests.helpers.torch_backend_data import counts, make_groups, max_abs_diff, spec

pytestmark = pytest.mark.timeout(300)

SETTINGS = {
    "e": LossSettings(entropy_coef=0.05, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"),
    "r": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.3, gamma=0.9),
}
SLOTS = {"e": 0, "r": 2}


def play(actor, set_weights) -> dict:
    """Random weights in both slots, one train call with per-token advantages, one step."""
    for i, (name, slot) in enumerate(SLOTS.items()):
        actor.load_adapter(spec(name, slot, rank=RANK, global_batch_size=6, loss=SETTINGS[name]))
        shapes = {k: v.shape for k, v in actor.export_adapter(name).items()}
        set_weights(slot, random_adapter(shapes, seed=200 + i))
    groups = make_groups("e", 0, 2, 3, seed=11) + make_groups("r", 2, 2, 3, seed=12)
    samples = [s for g in groups for s in g]
    reward_kl = actor.reward_kl(samples)
    advantages = adapter_token_advantages(
        torch.tensor([s.reward for s in samples]), [len(g) for g in groups], [g[0].adapter for g in groups],
        [[1] * len(s.response_ids) for s in samples], SETTINGS, reward_kl)
    stats = actor.train(samples, advantages, counts(samples))
    actor.step_adapters(list(SLOTS))
    return {"reward_kl": reward_kl, "loss": {n: s.loss_sum for n, s in stats.items()},
            "weights": {n: actor.export_adapter(n) for n in SLOTS}}


def _megatron_main(rank: int, model_dir: str, out: str) -> None:
    from miles.backends.megatron import lora as mlora
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor

    torch.set_num_threads(1)
    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint=model_dir, n_slots=4, lora_rank=RANK), rank, 1)
    actor.init_process_group(None)  # one rank: its own group, on a port the OS picks
    seen = play(actor, lambda slot, t: mlora.set_slot_weights(actor.model.parts, slot, t, rank=RANK, alpha=8.0))
    torch.save(seen, out)
    actor.shutdown()


def test_entropy_and_kl_shaped_reinforce_plus_plus_step_as_in_the_torch_backend(tiny_model_dir, tmp_path):
    from miles.backends.rank.config import TrainActorConfig
    from miles.backends.torch.actor import TorchTrainActor
    from miles.lora import set_slot_weights

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=4, lora_rank=RANK))
    ref = play(actor, lambda slot, t: set_slot_weights(actor.model.module, slot, t, rank=RANK, alpha=8.0))
    out = tmp_path / "megatron.pt"
    mp.start_processes(_megatron_main, args=(str(tiny_model_dir), str(out)), nprocs=1, join=True,
                       start_method="spawn")
    meg = torch.load(out, weights_only=False)
    kl_ref = [v for kl in ref["reward_kl"] for v in kl]
    kl_meg = [v for kl in meg["reward_kl"] for v in kl]
    assert len(kl_ref) == len(kl_meg) and max(abs(a - b) for a, b in zip(kl_ref, kl_meg)) <= 1e-4
    assert max(abs(v) for v in kl_ref) > 1e-3  # the shaping is live
    for name in SLOTS:
        assert meg["loss"][name] == pytest.approx(ref["loss"][name], abs=1e-5)
        # Adam's first step moves each weight by lr * g / (|g| + eps): where a gradient is a
        # near-cancellation, the rounding of another summation order (the backends differ
        # there) changes that step. Weights agree to 2.5e-4 (1/80 of lr 0.02) where losses
        # agree to 1e-5.
        assert max_abs_diff(meg["weights"][name], ref["weights"][name]) <= 2.5e-4
