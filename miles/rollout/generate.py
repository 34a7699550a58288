"""How one sample is generated: the built-in single turn, or a user's generate function.

A custom generate function (`--custom-generate-function-path`, or an adapter's
`custom_generate_function_path`) replaces single-turn generation for multi-turn and
tool-using rollouts. Its signature is Miles' current one:

    async def generate(input: GenerateFnInput) -> Sample: ...

`input.sample` is the sample to fill (prompt, `prompt_ids`, label, metadata),
`input.sampling_params` the process's sampling parameters, `input.args` the trainer's
config, `input.tokenizer` the prompts' tokenizer, and `input.engine` an `AdapterEngine`: it
generates through the router as this sample's adapter, with the adapter's current
engine-side LoRA name and a request id the controller's prefix abort reaches. The function
returns the sample with:

- `tokens` / `response_length` (or `response_ids`): every response token, the model's
  and the environment's, in order;
- `loss_mask`: 1 for the model's tokens, 0 for tool outputs and environment turns;
- `rollout_log_probs`: the engine's logprob of each response token (any value, 0.0 say,
  for masked tokens);
- `status`: `ABORTED` as soon as a turn comes back aborted (then the group is dropped);
- `response` (the text the reward reads) and optionally `reward`-relevant `metadata`.

`miles.recipes.calculator_tool` is a worked two-turn tool-use example.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from miles.utils.plugins import PluginError, load_object
from miles.utils.types import (
    FinishReason,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    Sample,
    SampleStatus,
    SamplingParams,
    adapter_rid,
)

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
"""A turn's `finish_reason.type` -> the sample status it implies."""


class AdapterEngine:
    """Generate as one adapter through the router (the handle a generate function gets).

    The engine-side LoRA name is looked up at every call, so each turn of a long
    conversation uses the weights the engines serve now (a `versioned` push unloads
    the previous name once no request uses it). Once the adapter is no longer
    sampleable (retired, or re-registered) a call answers an aborted response without
    sending anything: the controller's prefix abort stops the turn in flight, and this
    stops the turns after it.
    """

    def __init__(self, client: aiohttp.ClientSession, router_url: str, adapter: str,
                 lora_name: Callable[[], str | None]) -> None:
        self._client = client
        self.router_url = router_url.rstrip("/")
        self.adapter = adapter
        self._lora_name = lora_name
        self.requests = 0
        """Requests sent (turns generated) through this handle."""

    @property
    def lora_path(self) -> str | None:
        """The adapter's current engine-side LoRA name; None once it is no longer sampleable."""
        return self._lora_name()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | SamplingParams, *,
                       return_logprob: bool = True) -> GenerateResponse:
        """One `POST /generate` continuing `input_ids`; raises on an HTTP error.

        `sampling_params`: the fields of `SamplingParams` (a key it does not know is refused
        here, before anything is sent)."""
        rid = adapter_rid(self.adapter, uuid.uuid4().hex)
        lora_path = self._lora_name()
        if lora_path is None:
            return GenerateResponse(text="", output_ids=[], meta_info=GenerateMetaInfo(
                id=rid, finish_reason=FinishReason(type="abort", message=f"adapter '{self.adapter}' is retired"),
                prompt_tokens=len(input_ids), completion_tokens=0, output_token_logprobs=[]))
        request = GenerateRequest(input_ids=list(input_ids), lora_path=lora_path, rid=rid,
                                  sampling_params=SamplingParams.model_validate(sampling_params),
                                  return_logprob=return_logprob)
        payload = request.model_dump(mode="json", exclude_unset=True)
        self.requests += 1
        async with self._client.post(f"{self.router_url}/generate", json=payload) as response:
            if response.status >= 400:  # the engine's own words, not only the status line
                detail = (await response.text())[:500]
                raise aiohttp.ClientResponseError(response.request_info, response.history, status=response.status,
                                                  message=f"{response.reason}: {detail}", headers=response.headers)
            return GenerateResponse.model_validate(await response.json(content_type=None))


@dataclass(frozen=True)
class GenerateFnInput:
    """What a generate function is called with (Miles' `GenerateFnInput`, plus `engine`)."""

    args: Any
    """The trainer's config (`MilesConfig`)."""
    sample: Sample
    sampling_params: dict[str, Any]
    """`max_new_tokens`, `temperature`, `top_p`, `top_k`, `stop` of the process."""
    engine: AdapterEngine
    tokenizer: Any = None
    """The prompts' tokenizer (to encode tool outputs and environment turns)."""
    evaluation: bool = False


@dataclass(frozen=True)
class GenerateFnOutput:
    """Miles' wrapper of a generate function's result; returning the `Sample` itself works too."""

    samples: Sample


GenerateFn = Callable[[GenerateFnInput], Awaitable[Any]]


def load_generate_function(path: str, *, kind: str = "--custom-generate-function-path") -> GenerateFn:
    """The generate function at `path`: `async fn(input)`, or a class whose instances are one."""
    fn = load_object(path, kind=kind)
    if inspect.isclass(fn):
        fn = fn()
    if not callable(fn):
        raise PluginError(f"{kind} {path!r} is not callable (got {type(fn).__name__})")
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(fn)):
        raise PluginError(f"{kind} {path!r} must be an async function: async def generate(input: GenerateFnInput)")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise PluginError(
            f"{kind} {path!r} has the wrong signature: expected async fn(input: GenerateFnInput) -> Sample "
            "(Miles' three-argument form fn(args, sample, sampling_params) has no way to reach the "
            "adapter's engine-side name here)"
        ) from None
    return fn


def validate_rollout_plugins(generate_path: str | None, filter_path: str | None) -> None:
    """Check at registration an adapter's generate function and dynamic filter as they will be
    called (async, one input; fn(args, samples)); `PluginError` (a ValueError) says what to fix."""
    from miles.rollout.filters import load_dynamic_filter

    if generate_path is not None:
        load_generate_function(generate_path, kind="custom_generate_function_path")
    if filter_path is not None:
        load_dynamic_filter(filter_path, kind="dynamic_sampling_filter_path")


async def call_generate_function(fn: GenerateFn, input: GenerateFnInput) -> Sample:
    """Run a generate function and check what it returns."""
    output = await fn(input)
    sample = output.samples if isinstance(output, GenerateFnOutput) else output
    if not isinstance(sample, Sample):
        raise TypeError(f"a generate function must return the Sample it was given (or GenerateFnOutput), "
                        f"got {type(sample).__name__}")
    sample.validate()
    return sample


async def generate_single_turn(input: GenerateFnInput) -> Sample:
    """The built-in generate function: one turn, every response token trained on."""
    sample = input.sample
    out = await input.engine.generate(sample.prompt_ids, input.sampling_params)
    sample.response_ids = list(out.output_ids)
    sample.response = out.text
    sample.status = FINISH_STATUS[out.meta_info.finish_reason.type]
    sample.rollout_logprobs = [float(lp) for lp, _, _ in (out.meta_info.output_token_logprobs or [])]
    return sample
