"""The Tinker sampler (`miles.controller.tinker.sampler`) through the real sglang-router to a builtin engine.

Here (not under tests/controller/tinker/) for the engine fixtures: the tiny model, the random PEFT
adapters that stand in for sampler snapshots, and the trainer-side reference.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from miles.controller.tinker.sampler import Sampler, SamplingError, SnapshotUnavailableError, is_adapter_not_loaded
from miles.rollout.engines.router import Router
from miles.utils.types import SamplerSnapshot, SamplingRequestParams, StopReason

session_loop = pytest.mark.asyncio(loop_scope="session")

PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def engine(builtin_launcher, tiny_model_dir, tmp_path_factory):
    proc, url = builtin_launcher(tiny_model_dir, tmp_path_factory.mktemp("sampler_logs"), lora_paths={}, slots=2,
                                 extra=["--max-loaded-loras", "2"])
    yield url
    proc.terminate()


@pytest.fixture(scope="module")
async def router(engine, tmp_path_factory):
    router = await Router.launch([engine], log_path=tmp_path_factory.mktemp("sampler_router") / "router.log")
    yield router
    await router.shutdown()


@pytest.fixture
async def sampler(router):
    sampler = Sampler(router.url)
    yield sampler
    await sampler.aclose()


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


def snapshot(engine_adapters, adapter: str, name: str) -> SamplerSnapshot:
    return SamplerSnapshot(model_id="model-a", name=name, directory=str(engine_adapters[adapter]))


async def engine_state(client, url) -> dict:
    return (await client.get(url + "/get_server_info")).json()


@session_loop
async def test_a_snapshot_never_loaded_is_loaded_by_path_then_served(sampler, engine, client, engine_adapters,
                                                                     trainer_reference):
    snap = snapshot(engine_adapters, "ad0", "step-1")
    assert snap.lora_name.startswith("tinker-model-a-step-1-")
    assert snap.tinker_path == "tinker://model-a/sampler_weights/step-1"
    greedy = SamplingRequestParams(max_tokens=6, temperature=0.0, stop=[])
    first = await sampler.sample(snap, PROMPT, greedy)
    assert first.lora_loads == 1  # a snapshot new to the sampler is loaded before its first samples
    assert snap.lora_name in (await engine_state(client, engine))["loaded_loras"]
    second = await sampler.sample(snap, PROMPT, greedy)
    assert second.lora_loads == 0 and second.sequences == first.sequences
    # Unloaded behind the sampler's back (an engine restarted): the engine answers "not loaded",
    # the sampler loads it again and retries.
    assert (await client.post(engine + "/unload_lora_adapter", json={"lora_name": snap.lora_name})).status_code == 200
    third = await sampler.sample(snap, PROMPT, greedy)
    assert third.lora_loads == 1 and third.sequences == first.sequences
    # What the engine served is the snapshot's adapter: greedy tokens and logprobs as the trainer computes them.
    sequence = first.sequences[0]
    scored = trainer_reference.score(PROMPT, sequence.tokens, "ad0")
    assert sequence.tokens == scored.greedy_tokens
    assert sequence.logprobs == pytest.approx(scored.logprobs, abs=1e-4)
    assert sequence.stop_reason is StopReason.LENGTH


@session_loop
async def test_evicted_snapshot_is_reloaded_by_the_engine_and_samples_the_same(sampler, engine, client,
                                                                               engine_adapters):
    seeded = SamplingRequestParams(num_samples=2, max_tokens=8, temperature=1.0, seed=99, stop=[])
    snaps = [snapshot(engine_adapters, name, f"evict-{name}") for name in ("ad1", "ad2", "alt")]
    before = await sampler.sample(snaps[0], PROMPT, seeded)
    for snap in snaps[1:]:  # two more snapshots through a limit of two evict the first
        await sampler.sample(snap, PROMPT, SamplingRequestParams(max_tokens=1))
    state = await engine_state(client, engine)
    assert snaps[0].lora_name in state["evicted_loras"]
    after = await sampler.sample(snaps[0], PROMPT, seeded)
    assert after.lora_loads == 0  # the engine reloaded it itself, from the path it was loaded from
    assert (await engine_state(client, engine))["lora_loads"][snaps[0].lora_name] == 2
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    for a, b in zip(after.sequences, before.sequences):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


@session_loop
async def test_base_model_seeded_sampling_is_reproducible_and_samples_differ(sampler):
    params = SamplingRequestParams(num_samples=3, max_tokens=10, temperature=1.0, seed=7, stop=[])
    one = await sampler.sample(None, PROMPT, params)
    two = await sampler.sample(None, PROMPT, params)
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    assert len({tuple(s.tokens) for s in one.sequences}) == 3  # seed + i per sample
    other = await sampler.sample(None, PROMPT, SamplingRequestParams(num_samples=3, max_tokens=10, seed=8, stop=[]))
    assert [s.tokens for s in other.sequences] != [s.tokens for s in one.sequences]
    assert all(len(s.tokens) == 10 and s.stop_reason is StopReason.LENGTH for s in one.sequences)
    assert one.prompt_logprobs is None and one.sequences[0].topk_logprobs is None


@session_loop
async def test_top_k_and_top_p_reach_the_engine(sampler):
    greedy = await sampler.sample(None, PROMPT, SamplingRequestParams(max_tokens=8, temperature=0.0, stop=[]))
    for narrow in (dict(top_k=1), dict(top_p=1e-6)):  # only the most likely token is left to draw
        drawn = await sampler.sample(None, PROMPT, SamplingRequestParams(
            num_samples=2, max_tokens=8, temperature=1.5, stop=[], seed=5, **narrow))
        assert [s.tokens for s in drawn.sequences] == [greedy.sequences[0].tokens] * 2


@session_loop
async def test_stop_token_ids_and_stop_strings_end_a_sample_with_stop(sampler, trainer_reference):
    greedy = SamplingRequestParams(max_tokens=12, temperature=0.0, stop=[])
    tokens = (await sampler.sample(None, PROMPT, greedy)).sequences[0].tokens
    stop_token = tokens[3]
    cut = tokens.index(stop_token) + 1
    by_token = (await sampler.sample(None, PROMPT, SamplingRequestParams(max_tokens=12, temperature=0.0,
                                                                          stop=[stop_token]))).sequences[0]
    assert by_token.stop_reason is StopReason.STOP and by_token.tokens == tokens[:cut]
    assert len(by_token.logprobs) == cut

    text = trainer_reference.tokenizer.decode(tokens, skip_special_tokens=True)
    stop_text = text[4:6]
    assert stop_text
    by_text = (await sampler.sample(None, PROMPT, SamplingRequestParams(max_tokens=12, temperature=0.0,
                                                                         stop=stop_text))).sequences[0]
    assert by_text.stop_reason is StopReason.STOP
    assert by_text.tokens == tokens[:len(by_text.tokens)] and len(by_text.tokens) < len(tokens)
    assert stop_text in trainer_reference.tokenizer.decode(by_text.tokens, skip_special_tokens=True)

    short = (await sampler.sample(None, PROMPT, SamplingRequestParams(max_tokens=3, temperature=0.0))).sequences[0]
    assert len(short.tokens) <= 3


@session_loop
async def test_prompt_logprobs_and_top_k_equal_the_model(sampler, engine_adapters, trainer_reference):
    snap = snapshot(engine_adapters, "ad2", "scored")
    params = SamplingRequestParams(num_samples=2, max_tokens=4, temperature=0.0, stop=[], prompt_logprobs=True,
                                   topk_prompt_logprobs=3, topk_sample_logprobs=2)
    result = await sampler.sample(snap, PROMPT, params)
    scored = trainer_reference.score(PROMPT[:1], PROMPT[1:], "ad2")
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(PROMPT)
    assert result.prompt_logprobs[1:] == pytest.approx(scored.logprobs, abs=1e-4)
    top = result.topk_prompt_logprobs
    assert top[0] is None and len(top) == len(PROMPT)
    for position, row in enumerate(top[1:], start=1):
        assert len(row) == 3 and row[0][0] == scored.greedy_tokens[position - 1]
        assert [lp for _, lp in row] == sorted([lp for _, lp in row], reverse=True)
        own = dict(row).get(PROMPT[position])
        if own is not None:
            assert own == pytest.approx(result.prompt_logprobs[position], abs=1e-5)
    for sequence in result.sequences:  # greedy: the sampled token is the top one at each position
        assert [row[0][0] for row in sequence.topk_logprobs] == sequence.tokens
        assert [row[0][1] for row in sequence.topk_logprobs] == pytest.approx(sequence.logprobs, abs=1e-5)
        assert all(len(row) == 2 for row in sequence.topk_logprobs)

    last_two = await sampler.sample(snap, PROMPT, SamplingRequestParams(
        max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=2))
    assert last_two.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert last_two.prompt_logprobs[-2:] == pytest.approx(result.prompt_logprobs[-2:], abs=1e-6)
    assert last_two.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert [t for t, _ in last_two.topk_prompt_logprobs[-1]] == [t for t, _ in top[-1]]
    with pytest.raises(ValueError, match="prompt_logprobs_last_n"):
        await sampler.sample(snap, PROMPT, SamplingRequestParams(prompt_logprobs=True, prompt_logprobs_last_n=6))

    logprobs = await sampler.compute_logprobs(snap, PROMPT)
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(scored.logprobs, abs=1e-4)
    base = await sampler.compute_logprobs(None, PROMPT)
    assert base[1:] == pytest.approx(trainer_reference.score(PROMPT[:1], PROMPT[1:], None).logprobs, abs=1e-4)


@session_loop
async def test_a_snapshot_whose_directory_is_gone_fails_by_type(sampler, tmp_path):
    missing = SamplerSnapshot(model_id="model-a", name="gone", directory=str(tmp_path / "nothing"))
    with pytest.raises(SnapshotUnavailableError, match="tinker://model-a/sampler_weights/gone"):
        await sampler.sample(missing, PROMPT, SamplingRequestParams(max_tokens=2))
    with pytest.raises(SamplingError, match="HTTP 400"):
        await sampler.sample(None, [10**9], SamplingRequestParams(max_tokens=2))


def test_the_sampler_and_the_gateway_import_no_torch():
    code = ("import sys, miles.controller.tinker.sampler, miles.controller.tinker.sample_wire, "
            "miles.controller.tinker.sampling, miles.controller.tinker.routes; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_not_loaded_is_read_from_sglangs_words():
    assert is_adapter_not_loaded(400, '{"detail": "The following requested LoRA adapters are not loaded: x"}')
    assert not is_adapter_not_loaded(500, "not loaded")
    assert not is_adapter_not_loaded(400, "input_ids [5] are outside the vocabulary")
