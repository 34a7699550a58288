"""`--reward-key`, `--group-rm` and how reward functions are called."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from miles.rollout.rewards import RewardSpec, get_reward_fn
from miles.rollout.rewards.evaluate import reward_value, score_group, score_sample
from miles.utils.types import Sample


def sample(response: str, label: str | None = "4", index: int = 0) -> Sample:
    return Sample(adapter="a", slot=0, group_index=0, index=index, prompt="q", label=label, metadata={},
                  prompt_ids=[], response=response)


def test_reward_value_reads_numbers_and_keyed_dicts():
    assert reward_value(1, None) == 1.0 and reward_value(True, None) == 1.0
    assert reward_value({"score": -1.0, "acc": False}, "score") == -1.0
    with pytest.raises(ValueError, match=r"dict with keys \['acc', 'score'\]: set --reward-key"):
        reward_value({"score": 1.0, "acc": True}, None)
    with pytest.raises(ValueError, match="'reward' is not in the reward dict"):
        reward_value({"score": 1.0}, "reward")
    with pytest.raises(ValueError, match="not a dict"):
        reward_value(0.5, "score")
    with pytest.raises(ValueError, match="must be a number"):
        reward_value("1.0", None)


async def test_dapo_with_reward_key_score():
    fn = get_reward_fn("dapo")
    assert await score_sample(fn, None, sample("Answer: 4"), reward_key="score") == 1.0
    assert await score_sample(fn, None, sample("Answer: 5"), reward_key="score") == -1.0
    assert await score_sample(fn, None, sample("Answer: 4"), reward_key="acc") == 1.0


async def test_sympy_builtins_run_off_the_event_loop_thread():
    seen = []

    def spy(args, s):
        seen.append(threading.current_thread())
        return get_reward_fn("math")(args, s)

    from miles.rollout.rewards import builtin

    assert get_reward_fn("math") in builtin.THREADED_BUILTINS
    assert await score_sample(get_reward_fn("math"), None, sample("\\boxed{4}")) == 1.0
    assert await score_sample(spy, None, sample("\\boxed{4.0}")) == 1.0  # a user function: a thread too
    assert seen and seen[0] is not threading.current_thread()


@pytest.fixture
def group_module(tmp_path, monkeypatch):
    (tmp_path / "my_group_rm.py").write_text(textwrap.dedent("""
        async def rank_by_length(args, samples):
            # a group reward: the shortest response of the group gets 1, the others 0
            shortest = min(len(s.response) for s in samples)
            return [float(len(s.response) == shortest) for s in samples]

        def keyed(args, samples):
            return [{"score": float(i)} for i, _ in enumerate(samples)]

        def too_few(args, samples):
            return [1.0]

        def per_sample(args, sample):
            return float(len(sample.response))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_group_rm"
    sys.modules.pop("my_group_rm", None)


async def test_group_rm_scores_the_whole_group_with_one_call(group_module):
    group = [sample("abc", index=0), sample("a", index=1), sample("ab", index=2)]
    spec = RewardSpec(None, f"{group_module}.rank_by_length")
    assert await score_group(spec, None, group, group_rm=True) == [0.0, 1.0, 0.0]
    keyed = RewardSpec(None, f"{group_module}.keyed")
    assert await score_group(keyed, None, group, group_rm=True, reward_key="score") == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="must return one reward per sample"):
        await score_group(RewardSpec(None, f"{group_module}.too_few"), None, group, group_rm=True)


async def test_without_group_rm_every_sample_is_scored_alone(group_module):
    group = [sample("abc"), sample("a")]
    assert await score_group(RewardSpec(None, f"{group_module}.per_sample"), None, group) == [3.0, 1.0]
    # built-ins score each sample even with --group-rm
    assert await score_group(RewardSpec("exact", None), None, [sample("4"), sample("5")], group_rm=True) == [1.0, 0.0]
