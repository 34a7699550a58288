"""The Tinker routes under `/api/v1`, on the control plane's app (same port, same token).

Each route validates the SDK's body (JSON, or protobuf for `forward_backward`), translates
it into our typed command and hands it to the `TinkerGateway`; none calls the trainer.
`retrieve_future` long-polls the command log and answers as the SDK expects: a try-again
while the command is pending, the typed result once done (protobuf for forward passes),
`{"error", "category"}` once failed. `asample` starts a sample through the router
(`sampling.py`) and `retrieve_future` answers it the same way, its result as protobuf or
JSON by the client's `Accept` (`sample_wire.py`). The SDK authenticates with `X-API-Key: <token>`,
checked by the control plane's token middleware like the bearer token.

    install_tinker_routes(app, gateway)   # MultiLoRAHTTPServer.create_app does this
"""

from __future__ import annotations

import json
import logging
import math
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError

from miles.controller.tinker.checkpoints import (
    FILES_ROUTE,
    CheckpointFileError,
    CheckpointFileNotFoundError,
    CheckpointPath,
    CheckpointPathError,
    CheckpointRecord,
    CheckpointType,
)
from miles.controller.tinker.command_log import CommandLogError, ErrorCategory, Future, FutureKind, UnknownFutureError
from miles.controller.tinker.errors import GatewayBodyTooLargeError, GatewayError
from miles.controller.tinker.gateway import TinkerGateway
from miles.controller.tinker.models import LoraLayout
from miles.controller.tinker.proto import (
    DTYPE_INT64,
    ProtoDecodeError,
    WireForwardBackward,
    decode_forward_backward,
    encode_forward_backward_output,
)
from miles.controller.tinker.sample_wire import (
    UnsupportedSampleRequest,
    encode_sample_response,
    sample_request_from_json,
)
from miles.controller.tinker.sampling import NoRouterError, SampleFuture
from miles.controller.tinker.sessions import SessionInfo
from miles.controller.tinker.wire import (
    CheckpointTtlBody,
    CreateModelBody,
    CreateSamplingSessionBody,
    CreateSessionBody,
    LoadWeightsBody,
    ModelIdBody,
    OptimStepBody,
    RetrieveFutureBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
    SessionIdBody,
    WeightsInfoBody,
    WireBody,
)
from miles.utils.types import (
    CLIENT_LOSSES,
    AdamStep,
    ClientCommandKind,
    ClientCommandStatus,
    ClientDatum,
    ClientLoss,
    ForwardBackwardResult,
    ForwardCommand,
    OptimStepCommand,
    OptimStepResult,
    SaveForSamplerCommand,
)

logger = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=WireBody)

PROTOBUF = "application/x-protobuf"
MAX_FORWARD_BACKWARD_BYTES = 64 * 1024 * 1024
"""The SDK cuts a forward_backward into chunks of at most ~5 MB; larger bodies are refused (413)."""
MAX_JSON_BYTES = 1024 * 1024
JSON_FORWARD_REFUSAL = ("send forward_backward as a protobuf ForwardBackwardRequest (Content-Type: "
                        "application/x-protobuf; a forward sets forward_only), as tinker >= 0.24 does when "
                        "the client config asks for it, as this server's does")
"""What to send instead of the JSON `forward` / `forward_backward` bodies, which tinker 0.24 sends
unless its client config asks for protobuf (and 0.26 on never sends)."""
NO_RETRY = {"x-should-retry": "false"}
"""The SDK's HTTP client retries 409 unless told not to; our refusals are final."""


def install_tinker_routes(app: FastAPI, gateway: TinkerGateway) -> None:
    """Mount the routes and map the gateway's errors to statuses (by type, never by text)."""

    async def refuse(request: Request, exc: Exception) -> JSONResponse:
        status = (exc.status if isinstance(exc, GatewayError)
                  else 404 if isinstance(exc, UnknownFutureError | CheckpointFileNotFoundError)
                  else 401 if isinstance(exc, CheckpointFileError) else 400)
        retry = isinstance(exc, GatewayError) and exc.retryable
        return JSONResponse(status_code=status, content={"detail": str(exc)},
                            headers={"retry-after": "1"} if retry else NO_RETRY)

    # NoRouterError is a 400, not a 503: the SDK retries 5xx for minutes, and a trainer without
    # engines will not get any.
    for error in (GatewayError, CommandLogError, ProtoDecodeError, UnknownFutureError, UnsupportedSampleRequest,
                  NoRouterError, CheckpointPathError, CheckpointFileError, CheckpointFileNotFoundError):
        app.add_exception_handler(error, refuse)
    # Added as plain routes of the app (not a mounted sub-router), like the control plane's own.
    app.router.routes.extend(tinker_router(gateway).routes)


def tinker_router(gateway: TinkerGateway) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["tinker"])
    _service_routes(router, gateway)
    _model_routes(router, gateway)
    _command_routes(router, gateway)
    _checkpoint_routes(router, gateway)
    _sampling_routes(router, gateway)
    _future_routes(router, gateway)
    return router


def _service_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """The SDK's service calls: capabilities, client config, telemetry, sessions."""
    config = gateway.config

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        name = config.base_model or "any"
        sampleable = gateway.backend.router_url is not None
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": sampleable}]}

    @router.post("/client/config")
    async def client_config() -> dict[str, Any]:
        # Plain API keys, uncompressed protobuf forward_backward, futures polled one by one.
        # Three flags only the older SDKs read (0.38 does what they ask, always): 0.24 sends
        # forward_backward, and forward through it, as protobuf only when told to, and
        # 0.24-0.26 make a training client from a checkpoint with one load_weights only when told to.
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "use_pyqwest_transport": False,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": True,
                "proto_write_fwdbwd": True, "fwd_via_fwdbwd": True, "create_model_via_load_weights": True}

    @router.post("/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @router.post("/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's own telemetry: not kept

    @router.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = await _parse(request, CreateSessionBody)
        session_id = gateway.sessions.create(SessionInfo(
            tags=body.tags, user_metadata=body.user_metadata or {}, sdk_version=body.sdk_version,
            display_name=body.display_name))
        return {"type": "create_session", "session_id": session_id}

    @router.post("/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, str]:
        body = await _parse(request, SessionIdBody)
        gateway.sessions.heartbeat(body.session_id)
        return {"type": "session_heartbeat"}

    @router.get("/sessions")
    async def list_sessions(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0)) -> dict[str, Any]:
        return {"sessions": [s.session_id for s in gateway.sessions.all()[offset:offset + limit]]}

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        session = gateway.sessions.get(session_id)
        return {"training_run_ids": session.model_ids, "sampler_ids": [s.sampler_id for s in session.samplers],
                "user_metadata": session.info.user_metadata or None, "display_name": session.info.display_name}

    @router.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> dict[str, Any]:
        return {"unloaded": gateway.finish_session(session_id)}


def _model_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """Training clients: create, describe and unload a client-driven model."""
    config = gateway.config

    @router.post("/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await _parse(request, CreateModelBody)
        if body.optimizer_config.type != "adamw":
            raise GatewayError(f"optimizer_config.type {body.optimizer_config.type!r} is not supported; "
                               "this trainer steps every model with AdamW")
        lora = None if body.lora_config is None else LoraLayout(
            rank=body.lora_config.rank, seed=body.lora_config.seed, train_mlp=body.lora_config.train_mlp,
            train_attn=body.lora_config.train_attn, train_unembed=body.lora_config.train_unembed)
        future = gateway.create_model(body.session_id, body.model_seq_id, body.base_model, lora,
                                      body.user_metadata or {})
        return _untyped(future)

    @router.post("/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        body = await _parse(request, ModelIdBody)
        _, model = gateway.models.get(body.model_id)
        return {"type": "get_info", "model_id": body.model_id, "is_lora": True, "lora_rank": model.rank,
                "model_name": model.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": None, "model_name": model.base_model,
                               "tokenizer_id": config.tokenizer_id or model.base_model}}

    @router.post("/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        body = await _parse(request, ModelIdBody)
        return _untyped(gateway.unload_model(body.model_id))


def _command_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """A model's commands, logged in `seq_id` order for the trainer to run."""

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        wire = decode_forward_backward(await _protobuf_body(request))
        kind = ClientCommandKind.FORWARD if wire.forward_only else ClientCommandKind.FORWARD_BACKWARD
        return _untyped(gateway.submit(wire.model_id, wire.seq_id, kind, lambda: forward_command(wire)))

    @router.post("/forward")
    async def forward() -> None:
        raise GatewayError(f"POST /api/v1/forward is not served: {JSON_FORWARD_REFUSAL}")

    @router.post("/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await _parse(request, OptimStepBody)
        return _untyped(gateway.submit(body.model_id, body.seq_id, ClientCommandKind.OPTIM_STEP,
                                       lambda: optim_command(body)))

    @router.post("/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        body = await _parse(request, SaveWeightsBody)
        return _untyped(gateway.submit(
            body.model_id, body.seq_id, ClientCommandKind.SAVE_STATE,
            lambda: gateway.saves.save_state_command(body.model_id, body.path, body.overwrite)))

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        body = await _parse(request, SaveWeightsForSamplerBody)
        if body.kind != "snapshot":
            raise GatewayError(f"save_weights_for_sampler kind {body.kind!r} is not served: only immutable "
                               "'snapshot' sampler weights (save again to sample newer weights)")
        future = gateway.submit(body.model_id, body.seq_id, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                lambda: gateway.saves.sampler_command(body.model_id, body.path, body.seq_id))
        if body.path is None and body.sampling_session_seq_id is not None \
                and future.status is not ClientCommandStatus.FAILED:
            # save_weights_and_get_sampling_client: its future answers with a sampling session.
            gateway.samplers.create_for_save(body.model_id, body.sampling_session_seq_id, future)
        return _untyped(future)

    @router.post("/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await _parse(request, LoadWeightsBody)
        if body.model_id is None:  # create_training_client_from_state*: a new model, loaded first
            if body.session_id is None or body.model_seq_id is None:
                raise GatewayError("load_weights needs model_id (and seq_id), or session_id and model_seq_id")
            if body.optimizer_config is not None and body.optimizer_config.get("type", "adamw") != "adamw":
                raise GatewayError("optimizer_config: only AdamW ('adamw') is served")
            return _untyped(gateway.create_model_from_state(body.session_id, body.model_seq_id, body.path,
                                                            body.optimizer, body.base_model,
                                                            body.user_metadata or {}))
        return _untyped(gateway.submit(body.model_id, body.seq_id, ClientCommandKind.LOAD_STATE,
                                       lambda: gateway.saves.load_state_command(body.path, body.optimizer)))

    @router.post("/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        body = await _parse(request, SaveWeightsExternalBody)

        def export() -> Any:
            if body.age_encryption_recipients:
                raise GatewayError("age_encryption_recipients is not served: exports are plain PEFT files, "
                                   "sent over this trainer's own connection")
            return gateway.saves.external_command(body.model_id, body.path, body.ttl_seconds)

        return _untyped(gateway.submit(body.model_id, body.seq_id, ClientCommandKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                       export))


def _checkpoint_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """Training runs and their checkpoints, as the SDK's RestClient and `tinker checkpoint download` ask."""

    @router.get("/training_runs")
    async def list_training_runs(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0),
                                 project_id: str | None = None) -> dict[str, Any]:
        if project_id is not None:
            raise GatewayError("project_id: projects are not served by this trainer; list without one")
        model_ids = gateway.models.training_runs()
        return {"training_runs": [training_run(m) for m in model_ids[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(model_ids)}}

    @router.get("/training_runs/{model_id}")
    async def get_training_run(model_id: str) -> dict[str, Any]:
        return training_run(model_id)

    @router.get("/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str) -> dict[str, Any]:
        records = gateway.checkpoint_rules.checkpoints_of(model_id)
        return {"checkpoints": [_checkpoint(r) for r in records], "cursor": None}

    @router.get("/checkpoints")
    async def list_user_checkpoints(limit: int = Query(100, ge=1, le=1000),
                                    offset: int = Query(0, ge=0)) -> dict[str, Any]:
        records = gateway.checkpoint_rules.checkpoints_of()
        return {"checkpoints": [_checkpoint(r) for r in records[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}

    @router.post("/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        body = await _parse(request, WeightsInfoBody)
        path = CheckpointPath.parse(body.tinker_path)
        gateway.checkpoint_rules.checkpoint(path)
        _, model = gateway.models.get(path.model_id)
        return {"base_model": model.base_model, "optimizer_config": {"type": "adamw"}, "is_lora": True,
                "lora_rank": model.rank, "train_unembed": model.train_unembed, "train_mlp": model.train_mlp,
                "train_attn": model.train_attn}

    # Before the DELETE of a checkpoint, whose `{checkpoint_id:path}` would also match these.
    @router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    @router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish(model_id: str, checkpoint_id: str) -> None:
        raise GatewayError("publishing checkpoints is not served: this trainer's checkpoints are its clients' "
                           "own; download one (tinker checkpoint download) to share it")

    @router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/archive")
    async def archive(model_id: str, checkpoint_id: str) -> None:
        raise GatewayError("checkpoint archives are not served: download a checkpoint's PEFT files with "
                           "`tinker checkpoint download` of tinker >= 0.38 (get_external_weights_urls)")

    @router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_ttl(model_id: str, checkpoint_id: str, request: Request) -> Response:
        body = await _parse(request, CheckpointTtlBody)
        gateway.checkpoint_rules.set_ttl(CheckpointPath.of(model_id, checkpoint_id), body.ttl_seconds)
        return Response(status_code=204)

    @router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        record = gateway.checkpoint_rules.checkpoint(CheckpointPath.of(model_id, checkpoint_id))
        urls, expires = gateway.checkpoints.file_urls(record, str(request.base_url).rstrip("/"))
        return {"urls": urls, "expires": _iso(expires)}

    @router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> Response:
        gateway.checkpoint_rules.delete(CheckpointPath.of(model_id, checkpoint_id))
        return Response(status_code=204)

    @router.get(FILES_ROUTE.removeprefix("/api/v1") + "/{model_id}/{segment}/{name}/{file:path}")
    async def checkpoint_file(model_id: str, segment: str, name: str, file: str, expires: int | None = None,
                              signature: str | None = None) -> FileResponse:
        # Authenticated by its signature, not the token (the SDK downloads with plain urllib).
        if expires is None or signature is None:
            raise CheckpointFileError("a download URL needs its expires and signature: ask "
                                      "get_external_weights_urls for the checkpoint's URLs")
        path = CheckpointPath.of(model_id, f"{segment}/{name}")
        return FileResponse(gateway.checkpoints.open_file(path, file, expires, signature),
                            media_type="application/octet-stream")

    @router.post("/copy_weights")
    async def copy_weights() -> None:
        raise GatewayError("copy_weights is not served: load the checkpoint into a new training client "
                           "(create_training_client_from_state) and save it under the name you want")

    def training_run(model_id: str) -> dict[str, Any]:
        _, model = gateway.models.get(model_id)
        records = gateway.checkpoint_rules.checkpoints_of(model_id)
        last = {kind: next((_checkpoint(r) for r in records if r.path.kind is kind), None) for kind in CheckpointType}
        return {"training_run_id": model_id, "base_model": model.base_model, "model_owner": model.session_id,
                "is_lora": True, "corrupted": False, "lora_rank": model.rank,
                "last_request_time": _iso(gateway.models.last_request_time(model_id)),
                "last_checkpoint": last[CheckpointType.TRAINING],
                "last_sampler_checkpoint": last[CheckpointType.SAMPLER],
                "user_metadata": {k: str(v) for k, v in model.user_metadata.items()} or None}


def _sampling_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """Sampling sessions and samples through the router."""

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await _parse(request, CreateSamplingSessionBody)
        sampler = gateway.samplers.create(body.session_id, body.sampling_session_seq_id, body.model_path,
                                         body.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        sampler = gateway.samplers.get(sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @router.post("/asample")
    async def asample(request: Request) -> dict[str, Any]:
        wire = sample_request_from_json(_json(await _read_limited(request, MAX_JSON_BYTES, "sample body")))
        # A retry is recognised by (sampling session, seq_id); the SDKs before sampling sessions
        # name the model in each request, and their seq_ids are not unique to one client.
        sampler_id, seq_id = wire.sampling_session_id, wire.seq_id
        if sampler_id is not None:
            model_path = gateway.samplers.get(sampler_id).model_path
        else:
            model_path, seq_id = wire.model_path, None
            if model_path is None:
                assert wire.base_model is not None
                gateway.models.served_base_model(wire.base_model)
        snapshot = None if model_path is None else gateway.samplers.snapshot(model_path)
        future = gateway.samples.submit(
            sampler_id or model_path or "base", seq_id, wire.params.num_samples,
            lambda sampler: sampler.sample(snapshot, wire.prompt_tokens, wire.params))
        return {"request_id": future.future_id, "sample_sequence_ids": future.sequence_ids}


def _future_routes(router: APIRouter, gateway: TinkerGateway) -> None:
    """`retrieve_future`: every future's answer, command or sample."""
    config = gateway.config

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _parse(request, RetrieveFutureBody)
        if body.request_id in gateway.samples:
            sample = await gateway.samples.wait(body.request_id, config.retrieve_poll_s)
            if sample is None:
                raise UnknownFutureError(f"Unknown sample future {body.request_id!r} (a sample's result is kept "
                                         "until it is read and a while after; sample again)")
            return sample_response(sample, request.headers.get("accept"))
        future = await gateway.log.wait(body.request_id, config.retrieve_poll_s)
        sampler = gateway.samplers.made_by_save(future.future_id)
        return future_response(future, PROTOBUF in request.headers.get("accept", ""),
                               sampler_id=None if sampler is None else sampler.sampler_id)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:  # also a body that is not UTF-8
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body",), "msg": f"Malformed body: {exc}", "input": None}]) from None


async def _parse(request: Request, model: type[BodyT]) -> BodyT:
    """A JSON body as `model`; errors name the field and never echo the body back."""
    data = _json(await _read_limited(request, MAX_JSON_BYTES, "request body"))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat()


def _checkpoint(record: CheckpointRecord) -> dict[str, Any]:
    """A checkpoint as the SDK's `Checkpoint`."""
    return {"checkpoint_id": record.path.checkpoint_id, "checkpoint_type": record.path.kind.value,
            "time": _iso(record.time), "tinker_path": record.path.tinker_path, "size_bytes": record.size_bytes,
            "public": False, "expires_at": None if record.expires_at is None else _iso(record.expires_at)}


def _untyped(future: Future) -> dict[str, Any]:
    return {"request_id": future.future_id, "model_id": future.model_id}


async def _protobuf_body(request: Request) -> bytes:
    if request.headers.get("content-type", "").startswith("application/json"):
        raise GatewayError(f"a JSON forward_backward body is not served: {JSON_FORWARD_REFUSAL}")
    if request.headers.get("content-encoding", "identity") not in ("", "identity"):
        raise GatewayError(f"Content-Encoding {request.headers['content-encoding']!r} is not accepted "
                           "(the client config asks for uncompressed bodies)")
    return await _read_limited(request, MAX_FORWARD_BACKWARD_BYTES, "forward_backward body")


async def _read_limited(request: Request, limit: int, what: str) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes, declared or streamed."""
    too_large = GatewayBodyTooLargeError(f"{what} over {limit} bytes; send less per call")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def optim_command(body: OptimStepBody) -> OptimStepCommand:
    if body.optimizer_params is not None or body.adam_params is None:
        raise GatewayError("optim_step needs adam_params (AdamParams): every model here steps with AdamW")
    values = body.adam_params.model_dump()
    bad = sorted(k for k, v in values.items() if not math.isfinite(v) or v < 0)
    if bad:
        raise GatewayError(f"adam_params {bad} must be finite and >= 0")
    for beta in ("beta1", "beta2"):
        if values[beta] >= 1:  # the moments would never decay (and grow without bound above 1)
            raise GatewayError(f"adam_params.{beta} {values[beta]} must be in [0, 1)")
    if values["eps"] <= 0:
        raise GatewayError("adam_params.eps must be > 0 (it keeps the update finite where a gradient is 0)")
    return OptimStepCommand(adam=AdamStep(**values))


def forward_command(wire: WireForwardBackward) -> ForwardCommand:
    """Translate a decoded request; every refusal names the loss or the datum field."""
    if wire.loss_fn not in CLIENT_LOSSES:
        raise GatewayError(f"loss_fn {wire.loss_fn!r} is not supported; use one of {list(CLIENT_LOSSES)}")
    text = sorted(k for k, v in wire.loss_fn_config.items() if isinstance(v, str))
    if text:
        raise GatewayError(f"loss_fn_config {text}: only numbers are supported")
    if not wire.data:
        raise GatewayError("forward_backward needs at least one datum")
    datums = []
    for index, datum in enumerate(wire.data):
        if not datum.tokens:
            raise GatewayError(f"data[{index}].model_input is empty")
        if "target_tokens" not in datum.loss_fn_inputs:
            raise GatewayError(f"data[{index}].loss_fn_inputs needs target_tokens")
        inputs: dict[str, list[float] | list[int]] = {}
        for name, tensor in datum.loss_fn_inputs.items():
            if tensor.shape != [len(datum.tokens)]:
                raise GatewayError(f"data[{index}].loss_fn_inputs[{name!r}] has shape {tensor.shape}; "
                                   f"give one value per input token ({len(datum.tokens)})")
            inputs[name] = [int(v) for v in tensor.values] if tensor.dtype == DTYPE_INT64 else tensor.values
        datums.append(ClientDatum(tokens=datum.tokens, inputs=inputs))
    config = {k: float(v) for k, v in wire.loss_fn_config.items()}
    return ForwardCommand(datums=datums, loss=ClientLoss(wire.loss_fn, config))  # type: ignore[arg-type]


def sample_response(sample: SampleFuture, accept: str | None) -> Response:
    """What `retrieve_future` answers for a sample: protobuf or JSON by `accept`, as the SDK asked."""
    if not sample.done:
        return JSONResponse({"type": "try_again", "request_id": sample.future_id, "queue_state": "active"})
    outcome = sample.outcome()
    if isinstance(outcome, tuple) and sample.retryable:
        return JSONResponse(status_code=410, content={"detail": outcome[0]})
    if isinstance(outcome, tuple):
        error, category = outcome
        return JSONResponse({"error": error, "category": category.value})
    body, content_type = encode_sample_response(outcome, accept)
    return Response(body, media_type=content_type)


def future_response(future: Future, protobuf: bool, sampler_id: str | None = None) -> Response:
    """What `retrieve_future` answers for `future` as it stands (`sampler_id`: the sampling
    session a save_weights_for_sampler made, answered with it)."""
    if not future.status.finished:
        return JSONResponse({"type": "try_again", "request_id": future.future_id, "queue_state": "active"})
    if future.expired and future.status is ClientCommandStatus.DONE:
        return JSONResponse({"error": f"the result of {future.kind.value} {future.future_id} expired: only the "
                                      "latest results of each model are kept; retrieve results as they finish",
                             "category": ErrorCategory.USER.value})
    if future.status is ClientCommandStatus.FAILED:
        category = future.category or ErrorCategory.SERVER
        return JSONResponse({"error": future.error or "failed", "category": category.value})
    kind, result, request = future.kind, future.result, future.request
    if kind in (FutureKind.FORWARD, FutureKind.FORWARD_BACKWARD):
        assert isinstance(result, ForwardBackwardResult)
        if protobuf:
            return Response(encode_forward_backward_output(result.outputs, result.metrics), media_type=PROTOBUF)
        return JSONResponse({
            "loss_fn_output_type": "ArrayRecord", "metrics": result.metrics,
            "loss_fn_outputs": [{name: {"data": values, "dtype": "float32", "shape": [len(values)]}
                                 for name, values in out.outputs.items()} for out in result.outputs]})
    if kind is FutureKind.OPTIM_STEP:
        assert isinstance(result, OptimStepResult)
        return JSONResponse({"metrics": result.metrics})
    if kind is FutureKind.CREATE_MODEL:
        return JSONResponse({"type": "create_model", "model_id": future.model_id})
    if kind is FutureKind.UNLOAD_MODEL:
        return JSONResponse({"type": "unload_model", "model_id": future.model_id})
    path = getattr(request, "tinker_path", None)
    wire_type = {FutureKind.SAVE_STATE: "save_weights", FutureKind.LOAD_STATE: "load_weights",
                 FutureKind.SAVE_WEIGHTS_FOR_SAMPLER: "save_weights_for_sampler"}[kind]
    if isinstance(request, SaveForSamplerCommand) \
            and CheckpointPath.parse(request.tinker_path).kind is CheckpointType.EXTERNAL:
        wire_type = "save_weights_external"  # an export: the same command, another directory
    answer: dict[str, Any] = {"type": wire_type, "path": path}
    if kind is FutureKind.LOAD_STATE:
        answer["model_id"] = future.model_id
    if sampler_id is not None:
        answer["sampling_session_id"] = sampler_id
    return JSONResponse(answer)
