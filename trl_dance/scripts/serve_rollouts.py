"""``trl-dance serve-rollouts``: a rollout worker on another GPU or node (the protocol: :mod:`trl_dance.rollout_service`).

    trl-dance serve-rollouts --model black-forest-labs/FLUX.1-dev --dtype bfloat16 --port 8100 --device cuda:0

then ``rollout_server_urls: [http://HOST:8100]`` in a GRPO, DiffusionNFT or online-DPO config with a LoRA. The worker
listens at once and loads the base pipeline meanwhile (``/health``: 503 ``loading``); the trainer's handshake sends
the sampler settings, the LoRA's shape and the autocast dtype (refused, naming each difference, where the worker's
base weights or software differ), then each version of the rollout weights before the chunks sampled with it. Endpoints: ``GET /health``, ``POST /handshake`` (JSON), ``PUT
/weights/{version}`` and ``POST /rollouts`` (safetensors bodies). ``--token`` (or ``TRL_DANCE_ROLLOUT_TOKEN``)
requires ``Authorization: Bearer TOKEN`` on every call but ``/health``. One trainer per worker; plain HTTP (put TLS in
front with a reverse proxy).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from dataclasses import dataclass, field

import torch

from ..rewards.remote import RefusedInput
from ..rewards.server import UNAUTHORIZED, authorized, read_body
from ..rollout_service import ROLLOUT_TOKEN_ENV, RolloutWorker, pack, unpack


def build_app(worker: RolloutWorker, token: str | None = None, max_body_bytes: int = 16 * 2**30):
    """A Starlette app serving ``worker``; with ``token``, every endpoint but ``/health`` answers 401 without
    ``Authorization: Bearer <token>``. Work runs in the thread pool, one chunk at a time (the worker's lock)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def refuse(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    def guarded(handler):
        async def endpoint(request):
            if not authorized(request, token):
                return refuse(401, UNAUTHORIZED)
            try:
                return await handler(request, await read_body(request, max_body_bytes, f"limit {max_body_bytes}"))
            except RefusedInput as refusal:  # (before ValueError, which it is)
                return refuse(refusal.status, str(refusal))
            except ValueError as err:  # a malformed body
                return refuse(400, f"bad request: {err}")

        return endpoint

    async def health(request):  # 503 while the model loads or after it failed to
        health = worker.health()
        return JSONResponse(health, status_code=503 if health["status"] in ("loading", "failed") else 200)

    async def handshake(request, body: bytes):
        return JSONResponse(await run_in_threadpool(worker.handshake, json.loads(body)))

    async def weights(request, body: bytes):
        version = int(request.path_params["version"])
        tensors, _ = unpack(body)
        return JSONResponse(
            {"version": version, "sha256": await run_in_threadpool(worker.load_version, version, tensors)}
        )

    async def rollouts(request, body: bytes):
        tensors, info = unpack(body)
        result, answer = await run_in_threadpool(worker.rollout, tensors, info)
        return Response(pack(result, answer), media_type="application/octet-stream")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/handshake", guarded(handshake), methods=["POST"]),
            Route("/weights/{version:int}", guarded(weights), methods=["PUT"]),
            Route("/rollouts", guarded(rollouts), methods=["POST"]),
        ]
    )


@dataclass
class RolloutWorkerArguments:
    """``trl-dance serve-rollouts``' options (``HfArgumentParser``, as the other commands)."""

    model: str = field(metadata={"help": "the base pipeline: a local folder or Hub id, as the trainer's"})
    pipeline_class: str | None = field(default=None, metadata={"help": "as the training config's pipeline_class"})
    dtype: str | None = field(
        default=None, metadata={"help": "as the training config's model_init_kwargs dtype (bfloat16)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "interface to listen on (0.0.0.0: every interface)"})
    port: int = 8100
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    max_versions: int = field(
        default=inspect.signature(RolloutWorker).parameters["max_versions"].default,  # the worker's own default
        metadata={"help": "weight versions held (max_staleness + 2)"},
    )
    token: str | None = field(
        default=None, metadata={"help": f"require 'Authorization: Bearer TOKEN' (default: ${ROLLOUT_TOKEN_ENV})"}
    )


def main(argv: list[str] | None = None) -> None:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        RolloutWorkerArguments,
        allow_abbrev=False,
        prog="trl-dance serve-rollouts",
        description="A rollout worker: the base pipeline sampling the trainer's chunks with the LoRA versions it "
        "publishes (rollout_server_urls in the training config). Needs the 'serve' extra.",
    )
    (args,) = parser.parse_args_into_dataclasses(argv)
    try:
        import uvicorn
    except ImportError as error:
        raise ValueError(
            f"serve-rollouts needs the 'serve' extra ({error.name} is missing): pip install 'trl-dance[serve]'"
        ) from error
    import threading
    from types import SimpleNamespace

    from ..trainer.diffusion_trainer import load_pipeline

    loading = SimpleNamespace(model_init_kwargs={"dtype": args.dtype} if args.dtype else None)
    worker = RolloutWorker(None, args.device, args.max_versions)
    token = args.token or os.environ.get(ROLLOUT_TOKEN_ENV) or None

    def load():  # while the server listens: a trainer tells "loading" from "not running" (connection refused)
        try:
            worker.load(lambda: load_pipeline(args.model, loading, args.pipeline_class).to(args.device), args.model)
        except Exception:  # /health reports it to the trainer, which stops naming it
            print(f"serve-rollouts: could not load {args.model}: {worker.failed}", file=sys.stderr, flush=True)
            return
        print(f"serving rollouts of {type(worker.pipeline).__name__} on {args.device}", flush=True)

    threading.Thread(target=load, name="load-model", daemon=True).start()
    print(
        f"rollout worker at http://{args.host}:{args.port}{' (token required)' if token else ''}, loading {args.model}",
        flush=True,
    )
    uvicorn.run(build_app(worker, token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
