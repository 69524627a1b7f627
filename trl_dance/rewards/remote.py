"""Rewards served over HTTP: the client a trainer calls, and the wire format it shares with ``trl-dance serve-reward``.

Protocol (JSON over HTTP):

* ``GET {url}/health`` → 200 ``{"status": "ok", "reward": NAME, ...}``.
* ``POST {url}/score`` with ``{"prompts": [B strings], "images": [B encoded images], "image_format": "png" | "jpeg" |
  "npy", "columns": {name: [B JSON values]}, "global_step": int}`` → ``{"rewards": [B numbers or null]}`` (null:
  the reward abstains on that row). An image is base64 of a PNG/JPEG file (8-bit) or of a ``numpy.save`` float32
  (3, H, W) array in [0, 1] (``npy``, lossless); a video is a list of such frames (``npy``: one (F, 3, H, W) array).
  PIL images in ``columns`` (image-to-video conditioning) travel as ``{"image": base64 PNG}``.
* Refusals are JSON ``{"error": MESSAGE}``: 400 malformed, 401 missing token, 413 over a limit, 503 with
  ``Retry-After`` when busy (the client retries 429/5xx within its budget, honouring Retry-After).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image_transforms import to_uint8

IMAGE_FORMATS = ("png", "jpeg", "npy")


class RemoteRewardError(RuntimeError):
    """A reward server failed: unreachable, timing out, an error status (``status``: the HTTP status it answered
    with, when it is the cause), or an answer of the wrong shape."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteRewardRefused(RemoteRewardError):
    """A reward server refused the request's credentials (401/403)."""


def encode_image(image: torch.Tensor, image_format: str, quality: int = 95) -> str | list[str]:
    """(3, H, W) (or a video (F, 3, H, W)) float in [0, 1] → base64 text (a list of frames for PNG/JPEG videos)."""
    if image_format == "npy":
        buffer = io.BytesIO()
        np.save(buffer, image.detach().float().cpu().numpy(), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")
    if image.ndim == 4:
        return [encode_image(frame, image_format, quality) for frame in image]
    buffer = io.BytesIO()
    options = {"quality": quality} if image_format == "jpeg" else {}
    Image.fromarray(to_uint8(image[None])[0]).save(buffer, format=image_format.upper(), **options)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class RefusedInput(ValueError):
    """A request a server refuses, with the HTTP status to answer: 400 (malformed), 413 (over a limit), 409 (a rollout
    worker's handshake or version mismatch); the message names the item."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def decode_image(
    data: Any,
    image_format: str,
    max_pixels: int | None = None,
    max_frames: int | None = None,
    where: str = "image",
) -> torch.Tensor:
    """The inverse of :func:`encode_image`: (3, H, W) or (F, 3, H, W) float32 in [0, 1]. An image's size is checked
    against ``max_pixels`` (per image or frame) from its header before it is decoded, a video's length against
    ``max_frames`` (``None``: no limit).

    Raises:
        RefusedInput (a ValueError) naming ``where``: 400 for anything malformed, 413 over a limit.
    """
    if isinstance(data, list):
        if not data or (max_frames is not None and len(data) > max_frames):
            raise RefusedInput(413 if data else 400, f"{where}: a video of {len(data)} frames (limit {max_frames})")
        return torch.stack(
            [
                decode_image(frame, image_format, max_pixels, max_frames, f"{where}[{i}]")
                for i, frame in enumerate(data)
            ]
        )
    if not isinstance(data, str):
        raise RefusedInput(400, f"{where}: expected base64 text, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RefusedInput(400, f"{where}: not base64 ({err})") from None
    try:
        if image_format == "npy":
            return _decode_npy(raw, max_pixels, max_frames, where)
        with Image.open(io.BytesIO(raw)) as image:  # reads the header only
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise RefusedInput(
                    413, f"{where}: {width}×{height} = {width * height} pixels (limit --max_pixels {max_pixels})"
                )
            array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    except RefusedInput:
        raise
    except Image.DecompressionBombError as err:
        raise RefusedInput(413, f"{where}: {err}") from None
    except Exception as err:  # PIL's UnidentifiedImageError, truncated files, numpy's header errors...
        raise RefusedInput(400, f"{where}: not a {image_format} image ({type(err).__name__}: {err})") from None
    return torch.from_numpy(array).permute(2, 0, 1)


def _decode_npy(raw: bytes, max_pixels: int | None, max_frames: int | None, where: str) -> torch.Tensor:
    buffer = io.BytesIO(raw)
    version = np.lib.format.read_magic(buffer)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(buffer)
    if dtype != np.float32 or len(shape) not in (3, 4) or shape[-3] != 3:
        raise RefusedInput(400, f"{where}: expected float32 (3, H, W) or (F, 3, H, W), got {dtype} {shape}")
    frames = shape[0] if len(shape) == 4 else 1
    if (max_pixels is not None and shape[-1] * shape[-2] > max_pixels) or (
        max_frames is not None and frames > max_frames
    ):
        raise RefusedInput(413, f"{where}: {shape} exceeds --max_pixels {max_pixels} or --max_frames {max_frames}")
    buffer.seek(0)
    return torch.from_numpy(np.load(buffer, allow_pickle=False)).float()


def _json_value(value: Any) -> Any:
    """A column value as JSON: PIL images as ``{"image": base64 PNG}``; anything else must be JSON already."""
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.convert("RGB").save(buffer, format="PNG")
        return {"image": base64.b64encode(buffer.getvalue()).decode("ascii")}
    return value


def post_with_retries(
    client,
    url: str,
    payload: dict[str, Any] | bytes,
    max_retries: int,
    backoff: float,
    where: str,
    method: str = "POST",
):
    """POST (or ``method``) ``payload`` (JSON, or raw bytes) and return the 200 response, retrying after a timeout, a connection
    error, 429 or a 5xx status (waiting ``backoff · 2^k`` s before attempt k + 1); RemoteRewardError naming ``where``
    otherwise."""
    import httpx

    body = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    last, retry_after = "", 0.0
    for attempt in range(max_retries + 1):
        if attempt:  # a busy server's Retry-After (503, 429) is honoured, within the retry budget
            time.sleep(max(backoff * 2 ** (attempt - 1), retry_after))
        try:
            response = client.request(method, url, **body)
        except httpx.TimeoutException:
            last = f"no answer within {client.timeout.read:g} s"
            continue
        except httpx.TransportError as err:  # refused, reset, closed mid-answer: the server is down or dying
            last = f"{type(err).__name__}: {err}"
            continue
        if response.status_code == 429 or response.status_code >= 500:
            last = f"status {response.status_code}: {response.text[:300]}"
            retry_after = _seconds(response.headers.get("retry-after"))
            continue
        if response.status_code != 200:
            raise RemoteRewardError(
                f"{where}: status {response.status_code}: {response.text[:300]}", response.status_code
            )
        return response
    raise RemoteRewardError(f"{where}: failed after {max_retries + 1} attempts; last: {last}")


def _seconds(value: str | None, most: float = 60.0) -> float:
    """A Retry-After header's delay in seconds (0 if absent or not a number of seconds), at most ``most``."""
    try:
        return min(max(float(value), 0.0), most) if value is not None else 0.0
    except ValueError:
        return 0.0


class HTTPReward:
    """What the HTTP rewards share: retry settings and one lazily opened connection pool, used by the concurrent
    requests of a call (``httpx.Client`` is thread-safe)."""

    def _init_http(
        self, max_concurrency: int, timeout: float, max_retries: int, backoff: float, headers: dict[str, str] | None
    ) -> None:
        if max_concurrency < 1 or max_retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError("max_concurrency must be >= 1, max_retries and backoff >= 0, timeout > 0")
        self.max_concurrency, self.timeout, self.max_retries, self.backoff = (
            max_concurrency,
            timeout,
            max_retries,
            backoff,
        )
        self.headers = dict(headers or {})
        self._client = None

    @property
    def client(self):
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=self.max_concurrency)
            self._client = httpx.Client(timeout=self.timeout, headers=self.headers, limits=limits)
        return self._client

    def _post(self, url: str, payload: dict[str, Any] | bytes, where: str):
        return post_with_retries(self.client, url, payload, self.max_retries, self.backoff, where)

    def _map(self, fn, *items: list) -> list:
        """``fn`` over ``items``, ``max_concurrency`` calls at a time, results in order."""
        with ThreadPoolExecutor(max(1, min(self.max_concurrency, len(items[0])))) as pool:
            return list(pool.map(fn, *items))

    def probe(self, wait: float | None = None) -> None:
        """Check that something listens at the reward's address, polling for up to ``wait`` seconds (default: the
        request ``timeout``) so that a server started beside the trainer has time to load: trainers call it when they
        are built, before any model work.

        Raises:
            RemoteRewardError naming the address and what to check.
        """
        url = getattr(self, "url", None) or self.base_url
        parsed = urllib.parse.urlparse(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        deadline, error = time.monotonic() + (self.timeout if wait is None else wait), None
        while True:
            try:
                self._probe_once(parsed.hostname, port)
                return
            except RemoteRewardRefused:
                raise  # an answer, not an absence: waiting does not change it
            except (OSError, RemoteRewardError) as err:
                error = err
            if time.monotonic() >= deadline:
                raise RemoteRewardError(
                    f"reward {getattr(self, '__name__', type(self).__name__)!r}: nothing answers at {url} ({error}); "
                    "start the server first (e.g. `trl-dance serve-reward NAME --port PORT`) or check the address"
                ) from error
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _probe_once(self, host: str, port: int) -> None:
        """One probe: a TCP connection (a reward server's own protocol may have no side-effect-free request)."""
        import socket

        socket.create_connection((host, port), timeout=min(self.timeout, 5.0)).close()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class RemoteReward(HTTPReward):
    """A reward computed by a server speaking the protocol above (``trl-dance serve-reward``, or your own).

    Args:
        url: the server's base URL, e.g. ``http://10.0.0.5:8000``.
        name: the name it is logged under (default: ``remote_<host>_<port>``).
        batch_size: samples per request; a call's batches are sent ``max_concurrency`` at a time.
        timeout: seconds for one request (connect, send, wait, read).
        max_retries: further attempts of a request after a timeout, a connection error, 429 or a 5xx status, waiting
            ``backoff · 2^k`` seconds before attempt k + 1. Other 4xx statuses and malformed answers fail at once.
        image_format: ``png`` (8-bit, lossless), ``jpeg`` (8-bit, ``jpeg_quality``) or ``npy`` (float32, exact).
        videos: send videos whole (the server's reward scores videos); otherwise a trainer sends frames.
        token: the server's shared secret (``trl-dance serve-reward --token``), sent as ``Authorization: Bearer``;
            default: the ``TRL_DANCE_REWARD_TOKEN`` environment variable, if set.
        headers: extra HTTP headers.

    Every failure raises :class:`RemoteRewardError` naming the server, the batch and what went wrong: a reward is never
    silently replaced by a constant.
    """

    def __init__(
        self,
        url: str,
        name: str | None = None,
        batch_size: int = 16,
        max_concurrency: int = 4,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        image_format: str = "png",
        jpeg_quality: int = 95,
        videos: bool = False,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"a remote reward needs an http(s) URL, got {url!r}")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        token = token or os.environ.get("TRL_DANCE_REWARD_TOKEN") or None
        headers = dict(headers or {}) | ({"Authorization": f"Bearer {token}"} if token else {})
        self._init_http(max_concurrency, timeout, max_retries, backoff, headers)
        self.url = url.rstrip("/")
        self.__name__ = name or f"remote_{parsed.hostname}_{parsed.port or parsed.scheme}"
        self.batch_size = batch_size
        self.image_format, self.jpeg_quality = image_format, jpeg_quality
        self.accepts_video = videos

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer; RemoteRewardError if it does not answer 200."""
        import httpx

        try:
            response = self.client.get(f"{self.url}/health")
        except httpx.HTTPError as err:
            raise RemoteRewardError(f"reward server {self.url}: /health failed ({type(err).__name__}: {err})") from err
        if response.status_code != 200:
            raise RemoteRewardError(f"reward server {self.url}: /health answered {response.status_code}")
        return response.json()

    def _probe_once(self, host: str, port: int) -> None:
        """One probe: ``/health`` answering 200 (``trl-dance serve-reward`` listens only once its reward has scored
        a test image), then an empty ``/score`` request, which scores nothing but shows a wrong or missing token now
        (401) rather than at the first rollout."""
        import httpx

        self.health()
        try:
            response = self.client.post(f"{self.url}/score", json={"prompts": [], "images": []})
        except httpx.HTTPError:
            return  # /health answered: the address is right, and scoring reports its own errors
        if response.status_code in (401, 403):
            raise RemoteRewardRefused(
                f"reward server {self.url} refused the token ({response.status_code}: {response.text[:200]}); pass "
                "the server's --token as token= in reward_kwargs or TRL_DANCE_REWARD_TOKEN"
            )

    def __call__(
        self, prompts: list[str], images: torch.Tensor, completions=None, **columns: Any
    ) -> list[float | None]:
        state = columns.pop("trainer_state", None)
        columns.pop("log_metric", None)
        count = len(prompts)
        if images.shape[0] != count:
            raise ValueError(f"{count} prompts for {images.shape[0]} images")
        starts = list(range(0, count, self.batch_size))
        payloads = [
            {
                "prompts": list(prompts[a : a + self.batch_size]),
                "images": [
                    encode_image(image, self.image_format, self.jpeg_quality)
                    for image in images[a : a + self.batch_size]
                ],
                "image_format": self.image_format,
                "columns": {
                    key: [_json_value(v) for v in values[a : a + self.batch_size]] for key, values in columns.items()
                },
                "global_step": getattr(state, "global_step", None),
            }
            for a in starts
        ]
        results = self._map(self._score_batch, list(range(len(payloads))), starts, payloads)
        return [value for batch in results for value in batch]

    def _score_batch(self, index: int, start: int, payload: dict[str, Any]) -> list[float | None]:
        size = len(payload["prompts"])
        where = f"reward server {self.url}, batch {index} (samples {start}–{start + size - 1})"
        return self._parse(self._post(f"{self.url}/score", payload, where), size, where)

    @staticmethod
    def _parse(response, size: int, where: str) -> list[float | None]:
        try:
            rewards = response.json()["rewards"]
        except (ValueError, KeyError, TypeError) as err:
            raise RemoteRewardError(f"{where}: the answer has no 'rewards' list: {response.text[:300]!r}") from err
        if not isinstance(rewards, list) or len(rewards) != size:
            got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
            raise RemoteRewardError(f"{where}: {got} rewards for {size} samples")
        try:
            return [None if value is None or math.isnan(float(value)) else float(value) for value in rewards]
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(f"{where}: rewards must be numbers or null, got {rewards[:5]!r}") from err
