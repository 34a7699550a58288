"""The backend contract's specs: a client-driven adapter's `AdapterSpec`."""

from __future__ import annotations

from miles.backends.base import AdapterSpec
from miles.utils.types import AdapterState
from miles.utils.types.client_commands import ClientAdapterRun, ClientModelConfig


def test_a_client_model_becomes_a_spec_with_its_rank_alpha_and_seed_and_no_schedule_or_saves(tmp_path):
    config = ClientModelConfig(model_id="s:train:0", session_id="s", base_model="tiny", rank=8, alpha=32.0, seed=3,
                               save=tmp_path)
    run = ClientAdapterRun(name="s-train-0", config=config, state=AdapterState.ACTIVE, slot=5, version=1, step=2,
                           registration_id="abc")
    spec = AdapterSpec.for_client(run)
    assert (spec.name, spec.slot, spec.rank, spec.alpha, spec.seed) == ("s-train-0", 5, 8, 32.0, 3)
    assert spec.global_batch_size == 1 and spec.registration_id == "abc"
    assert spec.save_dir is None and spec.num_step is None and spec.lr_decay_style == "constant"
