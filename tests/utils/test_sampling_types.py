"""Sampler snapshot names and paths, and the checks of a sampling request."""

from __future__ import annotations

import doctest

import pytest

import miles.utils.types.sampling as sampling
from miles.utils.types import (
    SamplerSnapshot,
    SamplingRequestParams,
    parse_sampler_weights_path,
    sampler_weights_path,
    snapshot_lora_name,
)


def test_doctests():
    assert doctest.testmod(sampling).failed == 0


def test_names_follow_the_path_and_never_collide():
    snap = SamplerSnapshot(model_id="run-1", name="step 3", directory="/s/run-1/step 3")
    assert snap.tinker_path == "tinker://run-1/sampler_weights/step 3"
    assert snap.lora_name.startswith("tinker-run-1-step_3-")
    assert snap.lora_name == snapshot_lora_name("run-1", "step 3")  # a pure function of the path
    names = {snapshot_lora_name(m, n) for m, n in [("a-b", "c"), ("a", "b-c"), ("a", "b c"), ("a", "b_c")]}
    assert len(names) == 4
    with pytest.raises(ValueError, match="non-empty"):
        snapshot_lora_name("", "x")


def test_sampler_weights_paths_round_trip():
    assert parse_sampler_weights_path(sampler_weights_path("m-1", "s")) == ("m-1", "s")
    for bad in ("tinker://m/weights/s", "http://m/sampler_weights/s", "tinker://m/sampler_weights/", "tinker://m"):
        with pytest.raises(ValueError, match="not a sampler snapshot path"):
            parse_sampler_weights_path(bad)


def test_sampling_request_checks_say_what_to_fix():
    with pytest.raises(ValueError, match="num_samples"):
        SamplingRequestParams(num_samples=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingRequestParams(max_tokens=-1)
    with pytest.raises(ValueError, match="all strings or all token ids"):
        SamplingRequestParams(stop=["a", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prompt_logprobs_last_n"):
        SamplingRequestParams(prompt_logprobs_last_n=0)
