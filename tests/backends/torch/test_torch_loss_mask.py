"""Per-token loss masks (multi-turn samples): tool and environment tokens carry no loss.

In a causal model a token only conditions later positions, so a response whose last
tokens are masked out must train exactly like the same response cut before them; and a
mask must change training (it is not ignored).
"""

from __future__ import annotations

import dataclasses

import pytest

from miles.backends.common.batching import make_micro_batches
from miles.utils.loss_settings import LossSettings
from miles.utils.types import Sample
from tests.helpers.torch_backend_data import counts, flatten_with_advantages, make_groups, max_abs_diff, new_actor, spec

LOSS = LossSettings(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, tis_clip=2.0, use_kl_loss=True,
                    kl_loss_coef=0.05, kl_loss_type="k3")
TOOL_TOKENS = [11, 12, 13]


def _with_tool_tail(sample: Sample) -> Sample:
    """The sample followed by an (environment) tool output that is masked out."""
    n = len(sample.response_ids)
    return dataclasses.replace(sample, response_ids=sample.response_ids + TOOL_TOKENS,
                               rollout_logprobs=sample.rollout_logprobs + [0.0] * len(TOOL_TOKENS),
                               loss_mask=[1] * n + [0] * len(TOOL_TOKENS))


def _train(tiny_model_dir, groups):
    actor = new_actor(tiny_model_dir, micro_batch_size=3, loss=LOSS)
    actor.load_adapter(spec("a", 0, global_batch_size=4))
    samples, adv = flatten_with_advantages(groups)
    stats = actor.train(samples, adv, counts(samples))
    actor.step_adapters(["a"])
    return stats["a"], actor.export_adapter("a")


def test_micro_batch_loss_mask_follows_the_sample_mask():
    s = Sample("a", 0, 0, 0, "", None, {}, [1, 2], response_ids=[3, 4, 5, 6], loss_mask=[1, 0, 0, 1])
    plain = Sample("a", 0, 1, 0, "", None, {}, [1], response_ids=[7, 8])
    mb = make_micro_batches([s, plain], [1.0, 1.0], None)[0]
    # position t predicts token t + 1: the response of `s` is predicted from positions 1..4
    assert mb.response_mask_BT.tolist() == [[0, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.loss_mask_BT.tolist() == [[0, 1, 0, 0, 1], [1, 1, 0, 0, 0]]


def test_a_mask_of_the_wrong_length_is_refused():
    s = Sample("a", 0, 0, 0, "", None, {}, [1, 2], response_ids=[3, 4], loss_mask=[1])
    with pytest.raises(ValueError, match="loss mask of 1 entries for 2 response tokens"):
        make_micro_batches([s], [1.0], None)


def test_masked_tool_tail_trains_like_the_response_without_it(tiny_model_dir):
    groups = make_groups("a", 0, 2, 2, seed=7)
    with_tail = [[_with_tool_tail(s) for s in g] for g in groups]
    stats_cut, weights_cut = _train(tiny_model_dir, groups)
    stats_tail, weights_tail = _train(tiny_model_dir, with_tail)
    assert stats_tail.tokens == stats_cut.tokens  # only the model's tokens are counted
    assert abs(stats_tail.loss_sum - stats_cut.loss_sum) < 1e-6
    assert max_abs_diff(weights_tail, weights_cut) <= 1e-6

    unmasked = [[dataclasses.replace(s, loss_mask=None) for s in g] for g in with_tail]
    stats_unmasked, weights_unmasked = _train(tiny_model_dir, unmasked)
    assert stats_unmasked.tokens == stats_cut.tokens + len(TOOL_TOKENS) * 4
    assert max_abs_diff(weights_unmasked, weights_cut) > 1e-4
