"""``trl-dance serve-reward NAME``: any reward of this package (or ``module:function``) behind the HTTP protocol of
:mod:`trl_dance.rewards.remote`, on Starlette and uvicorn (``pip install "trl-dance[serve]"``).

    trl-dance serve-reward hpsv2 --port 8000 --reward_kwargs '{"checkpoint": "/ckpt/HPS_v2.1_compressed.pt"}'

then ``reward_funcs: [http://HOST:8000]`` in a training config. Requests run in uvicorn's thread pool; model rewards
load once, on ``--device``, and score under their own lock.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from .base import get_reward_function, reward_name, score_images
from .remote import IMAGE_FORMATS, decode_image


def build_app(reward: Any, device: str = "cpu"):
    """A Starlette app serving ``reward`` (a reward function) at ``/score`` and ``/health``."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    name = reward_name(reward)

    def health(request):
        return JSONResponse({"status": "ok", "reward": name})

    async def score(request):
        try:
            body = await request.json()
            prompts, encoded = body["prompts"], body["images"]
            image_format = body.get("image_format", "png")
            if image_format not in IMAGE_FORMATS or len(prompts) != len(encoded):
                raise ValueError(
                    f"image_format must be one of {IMAGE_FORMATS}; {len(prompts)} prompts, {len(encoded)} images"
                )
            images = torch.stack([decode_image(item, image_format) for item in encoded]).to(device)
            columns = {key: [_column_value(v) for v in values] for key, values in body.get("columns", {}).items()}
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            return JSONResponse({"error": f"bad request: {type(err).__name__}: {err}"}, status_code=400)
        try:
            from starlette.concurrency import run_in_threadpool

            values = await run_in_threadpool(score_images, [reward], prompts, images, columns)
        except Exception as err:  # the reward's own failure: the client names it with the status
            return JSONResponse({"error": f"{name}: {type(err).__name__}: {err}"}, status_code=500)
        rewards = [None if math.isnan(v) else v for v in values[:, 0].tolist()]
        return JSONResponse({"rewards": rewards})

    return Starlette(routes=[Route("/health", health), Route("/score", score, methods=["POST"])])


def _column_value(value: Any) -> Any:
    """A column value from JSON: ``{"image": base64 PNG}`` back to a PIL image."""
    if isinstance(value, dict) and set(value) == {"image"}:
        import base64
        import io

        from PIL import Image

        return Image.open(io.BytesIO(base64.b64decode(value["image"]))).convert("RGB")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-dance serve-reward", description=__doc__.split("\n\n")[0])
    parser.add_argument("reward", help="a registered reward name or module.path:function")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--reward_kwargs", default=None, help="JSON: the reward's constructor arguments")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    import uvicorn

    reward = get_reward_function(args.reward, **json.loads(args.reward_kwargs or "{}"))
    uvicorn.run(build_app(reward, args.device), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
