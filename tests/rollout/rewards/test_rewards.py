"""Every built-in reward on a table of cases; reward specs checked as at registration."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles.rollout.rewards import (
    BUILTIN_REWARDS,
    RewardSpec,
    compute_reward,
    get_reward_fn,
    validate_reward_spec,
)
from miles.utils.types import Sample


def sample(response: str, label: str | None, prompt: str = "q", metadata: dict | None = None) -> Sample:
    return Sample(adapter="a", slot=0, group_index=0, index=0, prompt=prompt, label=label,
                  metadata=metadata or {}, prompt_ids=[], response=response)


CASES = [
    # rm_type, response, label, expected
    # Miles' `math`: the last boxed answer, equivalent to the (boxed or bare) label
    ("math", "so \\boxed{12} and later 13", "12", 1.0),
    ("math", "first \\boxed{3} then \\boxed{12}", "12", 1.0),
    ("math", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("math", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", 1.0),
    ("math", "\\boxed{x(x+2)}", "x^2+2x", 1.0),
    ("math", "\\boxed{1,000}", "1000", 1.0),
    ("math", "\\boxed{[1, 2)}", "[1,2)", 1.0),
    ("math", "\\boxed{13}", "12", 0.0),
    ("math", "The answer is 12", "12", 0.0),  # no box, no answer
    ("math", "\\boxed{12", "12", 0.0),
    ("math", "\\boxed{12}", "", 0.0),
    ("math", "\\boxed{12}", None, 0.0),
    # `deepscaler`: the same check after the reasoning only
    ("deepscaler", "<think>\\boxed{1}</think>So \\boxed{72}", "72", 1.0),
    ("deepscaler", "<think>\\boxed{72}</think>So \\boxed{1}", "72", 0.0),
    ("deepscaler", "So \\boxed{72}", "72", 0.0),  # no </think> and no ###Response
    ("deepscaler", "###Response \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("gemma_math", "\\boxed{1}<channel|>\\boxed{2}", "2", 1.0),
    ("gemma_math", "\\boxed{2}", "2", 1.0),
    # `final_number` (ours, the old `math`): the boxed answer, else the final number
    ("final_number", "12", "12", 1.0),
    ("final_number", "12.0", "12", 1.0),
    ("final_number", "The answer is 12", "12", 1.0),
    ("final_number", "3 apples and 4 pears make 7.", "7", 1.0),
    ("final_number", "so \\boxed{12} and later 13", "12", 1.0),
    ("final_number", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("final_number", "total 1,200 dollars", "1200", 1.0),
    ("final_number", "It is 12.", "#### 12", 1.0),
    ("final_number", "-3", "-3", 1.0),
    ("final_number", "The answer is 13", "12", 0.0),
    ("final_number", "12 then 11", "12", 0.0),
    ("final_number", "no number here", "12", 0.0),
    ("final_number", "\\boxed{12", "12", 1.0),  # unclosed box: falls back to the final number
    ("final_number", "\\boxed{}", "12", 0.0),
    ("final_number", "", "12", 0.0),
    ("final_number", "12", None, 0.0),
    ("final_number", "1/0", "12", 0.0),
    ("boxed_math", "\\boxed{12.00}", "12", 1.0),
    ("boxed_math", "12", "12", 0.0),
    ("boxed_math", "\\boxed{x^{2}}", "12", 0.0),
    ("exact", "  Paris \n", "Paris", 1.0),
    ("exact", "paris", "Paris", 0.0),
    ("exact", "Paris", None, 0.0),
    ("boxed_exact", "the city is \\boxed{ Paris }", "Paris", 1.0),
    ("boxed_exact", "Paris", "Paris", 0.0),
    ("f1", "the cat sat", "cat sat", 1.0),
    ("f1", "a dog", "the cat", 0.0),
    ("f1", "cat dog", "cat", 2 / 3),
    ("f1", "", "cat", 0.0),
    ("f1", "", "", 0.0),  # no common token, as Miles
    ("f1", "yes", "yes it is", 0.0),  # yes / no / noanswer only match themselves
    ("f1", "Yes.", "yes", 1.0),
    ("f1", "no", "no way", 0.0),
    ("f1", "Cat, SAT!", "cat sat", 1.0),
    ("boxed_f1", "\\boxed{red fox}", "red fox jumps", 0.8),
    ("boxed_f1", "red fox", "red fox", 0.0),
]


@pytest.mark.parametrize(("rm_type", "response", "label", "expected"), CASES)
def test_builtin_reward_table(rm_type, response, label, expected):
    assert get_reward_fn(rm_type)(None, sample(response, label)) == pytest.approx(expected)


DAPO_CASES = [
    # response, label, score, pred
    ("Work...\nAnswer: 72", "72", 1.0, "72"),
    ("Answer: 1,200 dollars", "1200", 1.0, "1200"),
    ("Answer: $\\boxed{34}$", "34.0", 1.0, "34"),
    ("Answer: x = 5", "5", 1.0, "5"),
    ("Answer: 3\nthen Answer: 4", "3", -1.0, "4"),  # the last Answer line counts
    ("The result is 72", "72", -1.0, "[INVALID]"),
    ("Answer: 72" + " padding" * 40, "72", -1.0, "[INVALID]"),  # beyond the last 300 characters
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # a non-integer label: text match
]


@pytest.mark.parametrize(("response", "label", "score", "pred"), DAPO_CASES)
def test_dapo_returns_miles_score_dict(response, label, score, pred):
    out = get_reward_fn("dapo")(None, sample(response, label))
    assert out == {"score": score, "acc": score == 1.0, "pred": pred}


GPQA_CASES = [
    # response, label, metadata, expected
    ("The answer is C.", "C", {}, 1.0),
    ("The answer is B.", "C", {}, 0.0),
    ("<think>maybe A</think> C is correct", "C", {}, 1.0),
    ("final answer: D", 3, {}, 1.0),  # an integer label indexes the letters
    ("I think B", "photosynthesis", {"choices": ["respiration", "photosynthesis"]}, 1.0),
    ("It must be photosynthesis", "photosynthesis", {"choices": ["respiration", "photosynthesis"]}, 1.0),
    ("It must be respiration", "photosynthesis", {"choices": ["respiration", "photosynthesis"]}, 0.0),
    ("The answer is E, not B", "B", {"valid_letters": ["A", "B", "C", "D"]}, 1.0),  # E is no option: B
    ("The answer is E, not B", "B", {}, 0.0),  # A-H by default: E
    ("answer: a", "x", {"correct_letter": "a"}, 1.0),
    ("", "A", {}, 0.0),
]


@pytest.mark.parametrize(("response", "label", "metadata", "expected"), GPQA_CASES)
def test_gpqa_picks_the_option_letter_or_its_text(response, label, metadata, expected):
    s = sample(response, None, metadata=metadata)
    s.label = label
    assert get_reward_fn("gpqa")(None, s) == expected


def test_math_equivalence_works_off_the_main_thread():
    # math-verify's own time bound needs the main thread; elsewhere it must still answer
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.append(get_reward_fn("math")(None, sample("\\boxed{2/4}", "0.5"))))
    worker.start()
    worker.join(timeout=60)
    assert out == [1.0]


def test_random_rewards_are_binary_and_deterministic_random_is_repeatable():
    values = {get_reward_fn("random")(None, sample("x", None)) for _ in range(200)}
    assert values == {0.0, 1.0}
    fn = get_reward_fn("deterministic_random")
    outcomes = [fn(None, sample(f"r{i}", None, prompt="p")) for i in range(64)]
    assert set(outcomes) == {0.0, 1.0}
    assert outcomes == [fn(None, sample(f"r{i}", None, prompt="p")) for i in range(64)]
    by_prompt = {fn(None, sample("same response", None, prompt=f"p{i}")) for i in range(64)}
    assert by_prompt == {0.0, 1.0}  # the prompt is part of the hash


def test_unknown_rm_type_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        validate_reward_spec("mathh", None)
    for name in BUILTIN_REWARDS:
        assert name in str(info.value)


def test_no_reward_at_all_says_what_to_set():
    with pytest.raises(ValueError, match="set rm_type in the adapter or --rm-type"):
        validate_reward_spec(None, None)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        async def length_reward(args, sample):
            return float(len(sample.response))

        def sync_reward(args, sample):
            return 0.25

        def one_arg(sample):
            return 1.0

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(("path", "message"), [
    ("my_rewards.missing", "cannot be imported"),
    ("no_such_module_xyz.fn", "cannot be imported"),
    ("my_rewards.NOT_CALLABLE", "is not callable"),
    ("my_rewards.one_arg", "wrong signature"),
    ("justaname", "dotted path"),
])
def test_custom_reward_path_errors(reward_module, path, message):
    with pytest.raises(ValueError, match=message):
        validate_reward_spec(None, path)


async def test_custom_rewards_sync_and_async(reward_module):
    validate_reward_spec(None, "my_rewards.length_reward")
    validate_reward_spec("math", "my_rewards:sync_reward")
    s = sample("abcd", "1")
    assert await compute_reward(RewardSpec(None, "my_rewards.length_reward").resolve(s), None, s) == 4.0
    assert await compute_reward(RewardSpec("math", "my_rewards.sync_reward").resolve(s), None, s) == 0.25


async def test_spec_resolution_order_adapter_then_metadata_then_flag():
    s = sample("Paris", "paris", metadata={"rm_type": "f1"})
    assert RewardSpec("exact", None, default_rm_type="math").resolve(s) is get_reward_fn("exact")
    assert RewardSpec(None, None, default_rm_type="exact").resolve(s) is get_reward_fn("f1")
    plain = sample("Paris", "paris")
    assert RewardSpec(None, None, default_rm_type="exact").resolve(plain) is get_reward_fn("exact")
    assert await compute_reward(RewardSpec(None, None, "exact").resolve(s), None, s) == 1.0
