"""The builtin inference server: SGLang's HTTP API over a HF model and the LoRA slot table.

    python -m miles.rollout.engines.builtin_server --model-path DIR --host 127.0.0.1 \\
        --port 30000 --max-loras-per-batch 4 --max-lora-rank 8 \\
        --lora-target-modules all-linear [--lora-paths NAME=DIR ...] \\
        [--max-loaded-loras N] [--engine-lora-update in_place|versioned] \\
        [--dtype float32|bfloat16] [--device cpu|cuda] [--num-threads 1]

Flag names follow `sglang.launch_server` (plus `--engine-lora-update`). Routes (request
and response shapes as SGLang's): /generate, /abort_request, /load_lora_adapter
(plus `upsert` in `in_place` mode), /unload_lora_adapter, /init_weights_update_group,
/destroy_weights_update_group, /load_lora_adapter_from_distributed (`in_place` mode
only, as SGLang 0.5 releases lack it), /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /pause_generation, /continue_generation. Bad input
answers 4xx with a message (`{"detail": ...}`, plus SGLang's own fields) and the
server keeps serving.

Once its port is bound it writes `Builtin engine server listening at http://HOST:PORT` to
stdout; `--port 0` binds a port the OS picks, which that line reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from miles.rollout.engines.builtin_engine import (
    BuiltinEngine,
    EngineInternalError,
    EngineOptions,
    EngineRequestError,
    WeightsUpdateGroupError,
)
from miles.rollout.engines.lora_table import LoraRequestError
from miles.rollout.engines.server_command import BUILTIN_URL_PREFIX
from miles.utils.network import tcp_listener
from miles.utils.types import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraFromDistributedRequest,
    LoadLoraRequest,
    SamplingParams,
    UnloadLoraRequest,
)

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: str = "abort"
    """SGLang's modes: "abort" finishes in-flight requests; "retract"/"in_place" hold them."""


def create_app(engine: BuiltinEngine) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        engine.stop()

    app = FastAPI(title="Miles builtin engine", lifespan=lifespan)

    @app.exception_handler(EngineRequestError)
    async def bad_request(request: Request, exc: EngineRequestError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc), "success": False, "error_message": str(exc)})

    @app.exception_handler(LoraRequestError)
    async def bad_lora_request(request: Request, exc: LoraRequestError) -> JSONResponse:
        # SGLang's LoRAUpdateOutput shape, plus `detail` like every other error here.
        return JSONResponse(status_code=400, content={"detail": str(exc), "success": False, "error_message": str(exc),
                                                      "loaded_adapters": engine.table.loaded()})

    @app.exception_handler(EngineInternalError)
    async def internal_error(request: Request, exc: EngineInternalError) -> JSONResponse:
        return JSONResponse(status_code=500, content={"detail": str(exc), "success": False, "error_message": str(exc)})

    @app.exception_handler(WeightsUpdateGroupError)
    async def bad_group_request(request: Request, exc: WeightsUpdateGroupError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc), "success": False, "message": str(exc)})

    add_routes(app, engine)
    return app


def add_routes(app: FastAPI, engine: BuiltinEngine) -> None:
    @app.post("/generate")
    async def generate(request: GenerateRequest) -> Any:
        result = await engine.generate(request)
        if isinstance(result, list):
            return [r.model_dump() for r in result]
        return result.model_dump()

    @app.post("/abort_request")
    async def abort_request(request: AbortRequest) -> dict[str, int]:
        return {"aborted": engine.abort(request)}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoraRequest) -> dict[str, Any]:
        return await engine.load_lora(request)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoraRequest) -> dict[str, Any]:
        return await engine.unload_lora(request.lora_name)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: InitWeightsUpdateGroupRequest) -> dict[str, Any]:
        return await engine.init_weights_update_group(request)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: DestroyWeightsUpdateGroupRequest) -> dict[str, Any]:
        return await engine.destroy_weights_update_group(request.group_name)

    if engine.options.lora_update == "in_place":
        @app.post("/load_lora_adapter_from_distributed")
        async def load_lora_adapter_from_distributed(request: LoadLoraFromDistributedRequest) -> dict[str, Any]:
            return await engine.load_lora_from_distributed(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.scheduler.paused:
            return PlainTextResponse("generation is paused", status_code=503)
        probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(engine.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return PlainTextResponse("generation did not answer in time", status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # No prefix cache to drop: every request prefills its own KV cache.
        return PlainTextResponse("Cache flushed.")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        body = await request.body()
        try:
            mode = PauseRequest.model_validate_json(body).mode if body.strip() else "abort"
        except ValidationError as exc:
            raise EngineRequestError(
                f"pause_generation takes {{\"mode\": \"abort\"|\"retract\"|\"in_place\"}}: {exc}") from None
        engine.pause(mode)
        return {"status": "paused", "mode": mode}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        engine.resume()
        return {"status": "running"}


def _lora_path(text: str) -> tuple[str, str]:
    """`NAME=DIR` (or just `DIR`, named after itself), as `--lora-paths` takes it."""
    name, sep, path = text.partition("=")
    return (name, path) if sep else (text, text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Miles builtin inference server (SGLang HTTP API).")
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory.")
    parser.add_argument("--tokenizer-path", default=None, help="Tokenizer directory (default: --model-path).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: a free port the OS picks (written to stdout).")
    parser.add_argument("--enable-lora", action="store_true",
                        help="Accepted for SGLang compatibility; LoRA is on when --max-loras-per-batch > 0.")
    parser.add_argument("--max-loras-per-batch", type=int, default=8, help="LoRA slots (0: no LoRA).")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--lora-target-modules", nargs="+", default=["all-linear"])
    parser.add_argument("--lora-paths", nargs="*", default=[], type=_lora_path,
                        help="NAME=DIR adapters loaded at start.")
    parser.add_argument("--max-loaded-loras", type=int, default=None,
                        help="Most adapters loaded at once; a load past it evicts the least recently used (as SGLang).")
    parser.add_argument("--engine-lora-update", choices=["in_place", "versioned"], default="in_place",
                        help="in_place: upsert and broadcast loads; versioned: SGLang 0.5's LoRA semantics.")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads on CPU.")
    parser.add_argument("--log-level", default="warning")
    return parser


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    targets = args.lora_target_modules
    return EngineOptions(
        model_path=args.model_path, tokenizer_path=args.tokenizer_path,
        max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
        lora_update=args.engine_lora_update, max_lora_rank=args.max_lora_rank,
        lora_target_modules="all-linear" if targets == ["all-linear"] else ",".join(targets),
        lora_paths=tuple(args.lora_paths), dtype=dtype, device=device,
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        random_seed=args.random_seed,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.num_threads)
    engine = BuiltinEngine(options_from_args(args))
    # Bound here rather than by uvicorn so that the port is known before serving: with
    # `--port 0` the OS picks a free one and the launcher reads it from this line.
    sock = tcp_listener(args.host, args.port)
    print(f"{BUILTIN_URL_PREFIX}http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level=args.log_level))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
