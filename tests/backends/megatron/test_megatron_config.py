"""Command-line flags of the Megatron backend land in its group layout (no model, no Ray)."""

from __future__ import annotations

import pytest

from miles.backends.megatron.train_group import MegatronGroupConfig
from miles.main.launch import build_backend
from miles.utils.arguments import parse_args


def _args(model_dir, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(model_dir), "--multi-lora-n-adapters", "2", "--train-backend", "megatron", *extra]


def test_tensor_parallel_ranks_per_data_parallel_replica(tiny_model_dir):
    cfg = parse_args(_args(tiny_model_dir, "--tensor-model-parallel-size", "2", "--actor-num-workers", "3"))
    group = MegatronGroupConfig.from_config(cfg)
    assert (group.n_workers, group.tp_size, group.world_size) == (3, 2, 6)
    assert group.actor.n_slots == 2 and group.num_gpus_per_worker == 0.0


def test_miles_placement_divides_the_gpus_by_the_tensor_parallel_size(tiny_model_dir):
    cfg = parse_args(_args(tiny_model_dir, "--tensor-model-parallel-size", "2",
                           "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4"))
    group = MegatronGroupConfig.from_config(cfg)
    assert (group.n_workers, group.world_size) == (4, 8)


def test_launch_builds_the_backend_the_flag_names(tiny_model_dir):
    from miles.backends.common.train_group import TrainGroup
    from miles.backends.megatron.actor import MegatronTrainActor
    from miles.backends.torch.actor import TorchTrainActor

    megatron = build_backend(parse_args(_args(tiny_model_dir, "--tensor-model-parallel-size", "2")))
    assert isinstance(megatron, TrainGroup) and megatron.rank_class is MegatronTrainActor
    assert megatron.config.world_size == 2 and megatron.ranks.layout.sharded
    torch_backend = build_backend(parse_args(["--hf-checkpoint", str(tiny_model_dir), "--multi-lora-n-adapters", "2"]))
    assert isinstance(torch_backend, TrainGroup) and torch_backend.rank_class is TorchTrainActor
    assert not torch_backend.ranks.layout.sharded


@pytest.mark.parametrize("extra, message", [
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be > 0"),
])
def test_unsupported_layouts_are_refused_at_parse_time(tiny_model_dir, extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(_args(tiny_model_dir, *extra))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_model_the_tensor_parallel_size_does_not_divide_is_refused(tiny_model_dir):
    from miles.backends.megatron.actor import MegatronActorConfig, MegatronTrainActor

    with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads"):
        MegatronTrainActor(MegatronActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=2, lora_rank=4,
                                               tensor_model_parallel_size=4), rank=0, world_size=4)


def test_a_rank_class_by_dotted_path_must_subclass_the_megatron_rank(tiny_model_dir):
    """`--train-actor-path` swaps the rank class the group starts; a torch rank cannot run as a Megatron one."""
    from miles.backends.megatron.actor import MegatronTrainActor
    from miles.backends.megatron.train_group import megatron_train_group
    from miles.utils.plugins import PluginError

    group = megatron_train_group(MegatronGroupConfig.from_config(parse_args(_args(tiny_model_dir))))
    assert group.rank_class is MegatronTrainActor
    wrong = parse_args(_args(tiny_model_dir, "--train-actor-path", "miles.backends.torch.actor.TorchTrainActor"))
    with pytest.raises(PluginError, match="--train-actor-path .*must be a subclass of .*MegatronTrainActor"):
        megatron_train_group(MegatronGroupConfig.from_config(wrong))
