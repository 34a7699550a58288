"""A Tinker client's whole training surface, as a user of an older `tinker` SDK writes it.

Run by `test_tinker_older_sdks.py` in a subprocess whose PYTHONPATH starts with the
directory of one SDK release (0.24.1, 0.26.2), against a controller on loopback:

    PYTHONPATH=.cache/tinker-sdk/0.26.2 python older_sdk_client.py URL TOKEN BASE_MODEL PROMPT_JSON

Only the API those releases share is used (their `create_*` calls return clients, not
futures). Each step prints one JSON line `{"step": name, ...}` with what the SDK decoded,
so the test checks the values and a failure shows how far the client got.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from typing import Any

import tinker
import torch
from tinker import types

TIMEOUT_S = 60


def emit(step: str, **values: Any) -> None:
    print(json.dumps({"step": step, **values}), flush=True)


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """Position i of `tokens` scores tokens[i + 1] (the last scores token 0)."""
    targets = [*tokens[1:], 0]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets, **inputs})


def outputs(result: types.ForwardBackwardOutput) -> dict[str, Any]:
    return {"metrics": result.metrics, "loss_fn_output_type": result.loss_fn_output_type,
            "outputs": [{name: tensor.tolist() for name, tensor in out.items()} for out in result.loss_fn_outputs]}


def sequences(response: types.SampleResponse) -> list[dict[str, Any]]:
    return [{"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop_reason": s.stop_reason}
            for s in response.sequences]


def main(url: str, token: str, base_model: str, prompt: list[int]) -> None:
    emit("sdk", version=tinker.__version__, path=tinker.__file__)
    service = tinker.ServiceClient(base_url=url, api_key=token)
    models = service.get_server_capabilities().supported_models
    emit("capabilities", models=[m.model_name for m in models])

    trainer = service.create_lora_training_client(base_model, rank=4, seed=7, train_mlp=False, train_unembed=False)
    info = trainer.get_info()
    emit("model", model_id=trainer.model_id, lora_rank=info.lora_rank, model_name=info.model_data.model_name,
         tokenizer_id=info.model_data.tokenizer_id)
    emit("tokenizer", ids=trainer.get_tokenizer().encode("one two three", add_special_tokens=False))

    # Every loss this SDK lists, each with the inputs and config it reads.
    rl = {"logprobs": [-0.5, -0.25, -1.0], "advantages": [1.0, -0.5, 2.0]}
    calls: list[tuple[str, types.Datum, dict[str, float] | None]] = [
        ("cross_entropy", datum([5, 6, 7], weights=[0.0, 1.0, 1.0]), None),
        ("importance_sampling", datum([8, 9, 10], **rl), None),
        ("ppo", datum([8, 9, 10], **rl), {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", datum([8, 9, 10], **rl), None),
        ("dro", datum([8, 9, 10], **rl), {"beta": 0.5}),
    ]
    futures = [(name, trainer.forward_backward([d], name, config)) for name, d, config in calls]
    step = trainer.optim_step(types.AdamParams(learning_rate=2e-4, beta2=0.99, weight_decay=0.01))
    emit("forward_backward", **{name: outputs(future.result(timeout=TIMEOUT_S)) for name, future in futures})
    emit("optim_step", metrics=step.result(timeout=TIMEOUT_S).metrics)
    emit("forward", **outputs(trainer.forward([datum([1, 2])], "cross_entropy").result(timeout=TIMEOUT_S)))

    def loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = sum((-lp).sum() for lp in logprobs)
        assert isinstance(total, torch.Tensor)
        return total, {"custom:sum": float(total.detach())}

    emit("forward_backward_custom",
         **outputs(trainer.forward_backward_custom([datum([5, 6])], loss).result(timeout=TIMEOUT_S)))

    saved = trainer.save_state("ckpt").result(timeout=TIMEOUT_S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_state may be marked deprecated; it is still served
        loaded = trainer.load_state(saved.path).result(timeout=TIMEOUT_S)
        resumed = trainer.load_state_with_optimizer(saved.path).result(timeout=TIMEOUT_S)
    emit("state", saved=saved.path, loaded=loaded.path, resumed=resumed.path)
    copy = service.create_training_client_from_state_with_optimizer(saved.path)
    emit("from_state", model_id=copy.model_id, lora_rank=copy.get_info().lora_rank,
         loss=copy.forward([datum([1, 2])], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"])

    snapshot = trainer.save_weights_for_sampler("snap").result(timeout=TIMEOUT_S)
    params = types.SamplingParams(max_tokens=5, seed=11, temperature=1.0, stop=[])
    model_input = types.ModelInput.from_ints(prompt)
    sampler = service.create_sampling_client(model_path=snapshot.path)
    sampled = sampler.sample(model_input, 2, params).result(timeout=TIMEOUT_S)
    scored = sampler.sample(model_input, 1, types.SamplingParams(max_tokens=1, temperature=0.0),
                            include_prompt_logprobs=True, topk_prompt_logprobs=2).result(timeout=TIMEOUT_S)
    logprobs = sampler.compute_logprobs(model_input).result(timeout=TIMEOUT_S)
    emit("sample", path=snapshot.path, base_model=sampler.get_base_model(), sequences=sequences(sampled),
         logprobs=logprobs, prompt_logprobs=scored.prompt_logprobs,
         topk_prompt_logprobs=[None if row is None else [list(p) for p in row]
                               for row in scored.topk_prompt_logprobs or []])
    quick = trainer.save_weights_and_get_sampling_client()
    emit("save_weights_and_get_sampling_client", sequences=sequences(quick.sample(model_input, 2, params).result(
        timeout=TIMEOUT_S)))
    base = service.create_sampling_client(base_model=base_model)
    emit("sample_base", sequences=sequences(base.sample(model_input, 2, params).result(timeout=TIMEOUT_S)))

    rest = service.create_rest_client()
    runs = rest.list_training_runs().result(timeout=TIMEOUT_S)
    run = rest.get_training_run(trainer.model_id).result(timeout=TIMEOUT_S)
    checkpoints = rest.list_checkpoints(trainer.model_id).result(timeout=TIMEOUT_S).checkpoints
    emit("rest", runs=[r.training_run_id for r in runs.training_runs], lora_rank=run.lora_rank,
         last_checkpoint=run.last_checkpoint.tinker_path if run.last_checkpoint else None,
         checkpoints=sorted(c.tinker_path for c in checkpoints),
         session=rest.get_session(service.holder.get_session_id()).result(timeout=TIMEOUT_S).training_run_ids)
    try:  # these releases download a checkpoint as one archive, which is not served
        rest.get_checkpoint_archive_url_from_tinker_path(saved.path).result(timeout=TIMEOUT_S)
        emit("archive", refused=None)
    except tinker.BadRequestError as refused:
        emit("archive", refused=str(refused))
    assert all(math.isfinite(v) for v in logprobs[1:] if v is not None)
    service.holder.close()  # what closing the service client does in these releases: its heartbeat stops
    emit("closed", session_id=service.holder.get_session_id())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
