"""``trl-dance serve-reward NAME``: any reward of this package (or ``module:function``) behind the HTTP protocol of
:mod:`trl_dance.rewards.remote`, on Starlette and uvicorn (``pip install "trl-dance[serve]"``).

    trl-dance serve-reward hpsv2 --port 8000 --reward_kwargs '{"checkpoint": "/ckpt/HPS_v2.1_compressed.pt"}'

then ``reward_funcs: [http://HOST:8000]`` in a training config. Requests are decoded and scored in uvicorn's thread
pool; model rewards load once, on ``--device``, and score under their own lock. Before it listens, the server scores
a test image (a video for video rewards) and exits naming the reward if that fails (missing weights, a missing
column), so a server that answers ``/health`` can score; ``--skip_test_score`` skips it (rewards that need a column).

Hardened for shared networks: every limit is checked before the work it bounds (the body's size while it is read,
an image's pixels from its header before it is decoded), every refusal is a JSON ``{"error": ...}`` naming the item
and the limit (400 malformed, 401 no token, 413 over a limit, 503 + ``Retry-After`` when ``--max_queue`` requests are
already in flight), and ``--token`` (or ``TRL_DANCE_REWARD_TOKEN``) makes ``/score`` require ``Authorization: Bearer
TOKEN``, compared in constant time. It speaks plain HTTP: for TLS put it behind a reverse proxy (nginx, Caddy).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from .base import RewardFunc, get_reward_function, reward_name, score_images
from .remote import IMAGE_FORMATS, RefusedInput, decode_image

TOKEN_ENV = "TRL_DANCE_REWARD_TOKEN"


@dataclass
class ServerLimits:
    """What one request may hold (defaults: a batch of 64 images of up to 16.7 MP, or videos of up to 256 frames).
    Each field is also ``trl-dance serve-reward``'s option of that name (``HfArgumentParser``: one default)."""

    max_body_mb: float = field(default=256.0, metadata={"help": "request body size in MiB"})
    max_images: int = field(default=64, metadata={"help": "images per request"})
    max_pixels: int = field(default=4096 * 4096, metadata={"help": "pixels per image or frame (read from its header)"})
    max_frames: int = field(default=256, metadata={"help": "frames per video"})
    max_prompt_chars: int = field(default=4096, metadata={"help": "characters per prompt"})
    max_queue: int = field(default=32, metadata={"help": "requests in flight; more get 503"})

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


def parse_request(body: bytes, limits: ServerLimits) -> tuple[list[str], torch.Tensor, dict[str, list]]:
    """A ``/score`` body as (prompts, images (B, ...), columns), every field and limit checked.

    Raises:
        RefusedInput: 400 naming the malformed field or item, 413 naming the item and the limit.
    """
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RefusedInput(400, f"bad request: the body is not JSON ({err})") from None
    if not isinstance(request, dict) or not isinstance(request.get("prompts"), list):
        raise RefusedInput(400, "bad request: expected an object with 'prompts' and 'images' lists")
    prompts, encoded = request["prompts"], request.get("images")
    image_format = request.get("image_format", "png")
    if not isinstance(encoded, list) or len(prompts) != len(encoded):
        raise RefusedInput(
            400, f"bad request: {len(prompts)} prompts, {len(encoded) if isinstance(encoded, list) else 0} images"
        )
    if image_format not in IMAGE_FORMATS:
        raise RefusedInput(400, f"bad request: image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    if len(encoded) > limits.max_images:
        raise RefusedInput(413, f"{len(encoded)} images in one request (limit --max_images {limits.max_images})")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RefusedInput(400, f"prompts[{i}]: expected text, got {type(prompt).__name__}")
        if len(prompt) > limits.max_prompt_chars:
            raise RefusedInput(
                413, f"prompts[{i}]: {len(prompt)} characters (limit --max_prompt_chars {limits.max_prompt_chars})"
            )
    images = [
        decode_image(item, image_format, limits.max_pixels, limits.max_frames, f"images[{i}]")
        for i, item in enumerate(encoded)
    ]
    if len({tuple(image.shape) for image in images}) > 1:
        raise RefusedInput(
            400, f"images of different shapes in one request: {sorted({tuple(i.shape) for i in images})}"
        )
    columns = request.get("columns") or {}
    if not isinstance(columns, dict) or any(
        not isinstance(v, list) or len(v) != len(prompts) for v in columns.values()
    ):
        raise RefusedInput(400, "bad request: columns must map names to one value per prompt")
    columns = {
        key: [_column_value(value, limits, f"columns[{key!r}][{i}]") for i, value in enumerate(values)]
        for key, values in columns.items()
    }
    return prompts, torch.stack(images) if images else torch.zeros(0, 3, 1, 1), columns


def _column_value(value: Any, limits: ServerLimits, where: str) -> Any:
    """A column value from JSON: ``{"image": base64 PNG}`` back to a PIL image (size-checked)."""
    if isinstance(value, dict) and set(value) == {"image"}:
        array = decode_image(value["image"], "png", limits.max_pixels, limits.max_frames, where)
        return Image.fromarray((array.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    return value


UNAUTHORIZED = "missing or wrong token: send 'Authorization: Bearer <token>'"


def authorized(request, token: str | None) -> bool:
    """Whether a Starlette ``request`` carries ``Authorization: Bearer <token>`` (compared in constant time); any
    request when ``token`` is None."""
    if not token:
        return True
    return hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {token}".encode())


async def read_body(request, max_bytes: int, limit: str) -> bytes:
    """A Starlette ``request``'s body, refused (``RefusedInput`` 413 naming ``limit``) by its declared length or, while
    it streams, as soon as it is over ``max_bytes``: never more than the limit is held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RefusedInput(413, f"a body of {declared} bytes ({limit})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RefusedInput(413, f"a body over {max_bytes} bytes ({limit})")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(reward: Any, device: str = "cpu", limits: ServerLimits | None = None, token: str | None = None):
    """A Starlette app serving ``reward`` (a reward function) at ``/score`` and ``/health`` within ``limits``; with
    ``token``, ``/score`` answers 401 unless the request carries ``Authorization: Bearer <token>``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    name, limits = reward_name(reward), limits or ServerLimits()
    body_limit = f"limit --max_body_mb {limits.max_body_mb:g}"
    in_flight = 0  # one event loop: no lock needed between the check and the increment

    def refuse(status: int, message: str, headers: dict[str, str] | None = None):
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def health(request):
        return JSONResponse({"status": "ok", "reward": name, "in_flight": in_flight, "max_queue": limits.max_queue})

    async def score(request):
        nonlocal in_flight
        if not authorized(request, token):
            return refuse(401, UNAUTHORIZED)
        if in_flight >= limits.max_queue:
            return refuse(
                503, f"busy: {in_flight} requests in flight (--max_queue {limits.max_queue})", {"Retry-After": "1"}
            )
        in_flight += 1
        try:
            try:
                body = await read_body(request, limits.max_body_bytes, body_limit)
                prompts, images, columns = await run_in_threadpool(parse_request, body, limits)
            except RefusedInput as refused:
                return refuse(refused.status, str(refused))
            if not prompts:
                return JSONResponse({"rewards": []})
            try:
                values = await run_in_threadpool(score_images, [reward], prompts, images.to(device), columns)
            except Exception as err:  # the reward's own failure: the client names it with the status
                return refuse(500, f"{name}: {type(err).__name__}: {err}")
            return JSONResponse({"rewards": [None if math.isnan(v) else v for v in values[:, 0].tolist()]})
        finally:
            in_flight -= 1

    return Starlette(routes=[Route("/health", health), Route("/score", score, methods=["POST"])])


def score_test_image(reward: Any, device: str) -> float:
    """Score one mid-grey 64×64 test image (a 2-frame video for ``accepts_video`` rewards) on ``device``: the model
    loads and runs once before the server listens. Returns the value (NaN: the reward abstained)."""
    shape = (1, 2, 3, 64, 64) if getattr(reward, "accepts_video", False) else (1, 3, 64, 64)
    return float(score_images([reward], ["a photo of a cat"], torch.full(shape, 0.5, device=device), {})[0, 0])


def served_reward(spec: str, reward_kwargs: str | None) -> RewardFunc:
    """The reward ``spec`` (a registered name or ``module:function``) built with ``reward_kwargs``, JSON of its
    constructor arguments (``{"model": DIR}``) or, as the trainers and the offline hints write them,
    ``{SPEC: {"model": DIR}}``."""
    kwargs = json.loads(reward_kwargs or "{}")
    if set(kwargs) == {spec} and isinstance(kwargs[spec], dict):
        kwargs = kwargs[spec]
    return get_reward_function(spec, **kwargs)


def main(argv: list[str] | None = None) -> None:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        ServerLimits,
        allow_abbrev=False,
        prog="trl-dance serve-reward",
        description="Any reward of trl-dance (a registered name or module:function) behind its HTTP protocol "
        '(trl_dance.rewards.remote), on Starlette and uvicorn: pip install "trl-dance[serve]".',
    )
    parser.add_argument("reward", help="a registered reward name or module.path:function")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--reward_kwargs",
        default=None,
        help='JSON: the reward\'s constructor arguments, {"model": DIR} or as the trainers take them, {NAME: {...}}',
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--token", default=None, help=f"require 'Authorization: Bearer TOKEN' (default: ${TOKEN_ENV})")
    parser.add_argument(
        "--skip_test_score",
        action="store_true",
        help="listen without scoring a test image first (rewards that need a column)",
    )
    limits, args = parser.parse_args_into_dataclasses(argv)
    try:
        import starlette  # noqa: F401  (build_app's)
        import uvicorn
    except ImportError as error:
        raise ValueError(
            f"serve-reward needs the 'serve' extra ({error.name} is missing): pip install 'trl-dance[serve]'"
        ) from error

    reward = served_reward(args.reward, args.reward_kwargs)
    name, start, tested = reward_name(reward), time.perf_counter(), ""
    if not args.skip_test_score:
        try:
            value = score_test_image(reward, args.device)
        except Exception as err:  # the reward's own failure, whatever it is: nothing is served
            sys.exit(
                f"trl-dance serve-reward: reward {name!r} failed on a test image, so nothing is served: "
                f"{type(err).__name__}: {err}\n(--skip_test_score listens anyway, for rewards that need a column)"
            )
        tested = f"; a test image scored {value:.4g} in {time.perf_counter() - start:.1f} s"
    token = args.token or os.environ.get(TOKEN_ENV) or None
    print(
        f"serving reward {name!r} at http://{args.host}:{args.port} (POST /score, GET /health) on {args.device}"
        f"{tested}{'; token required' if token else ''}",
        flush=True,
    )
    uvicorn.run(build_app(reward, args.device, limits, token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
