"""Base class of rewards that own a neural scorer, and the offline-friendly checkpoint lookup they share."""

from __future__ import annotations

import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from .image_transforms import check_images

# A Hub repository id ("org/name", or a legacy "name" such as bert-base-uncased); a path that cannot be one (absolute,
# relative to . or ~, nested, or a weights file) and does not exist is a local path with a typo.
_REPO_ID = re.compile(r"^([\w.-]+/)?[\w.-]+$")
_WEIGHT_FILES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
# Rewards configured by a trainer field rather than reward_kwargs: {reward name: (field of the checkpoint, of the rest)}.
CONFIG_FIELDS = {"step_aware_preference": ("step_aware_model", "step_aware_model_kwargs")}


def resolve_file(location: str, filename: str, what: str, reward: str, keyword: str) -> str:
    """A local checkpoint file: ``location`` itself, ``location/filename``, or ``filename`` of the Hub repo ``location``.
    ``reward`` and ``keyword`` (its constructor argument that took ``location``) name the setting in the advice.

    Raises:
        FileNotFoundError saying what to download and where to point the reward when nothing local exists and the
        Hub cannot be reached (offline machines, ``HF_HUB_OFFLINE=1``), or that a local path does not exist.
    """
    if os.path.isfile(location):
        return location
    if os.path.isdir(location):
        candidate = os.path.join(location, filename)
        if os.path.isfile(candidate):
            return candidate
        raise FileNotFoundError(f"{what}: {location!r} is a directory without {filename!r}")
    _check_local(location, what, reward, keyword)
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(location, filename)
    except Exception as err:  # offline, unknown repo, no permission: all end in the same advice
        raise FileNotFoundError(_download_advice(what, location, reward, keyword, filename, err)) from err


def resolve_directory(location: str, what: str, reward: str, keyword: str) -> str:
    """A local checkpoint directory: ``location`` itself, or a snapshot of the Hub repo ``location``.

    Raises:
        FileNotFoundError with the same advice as :func:`resolve_file`.
    """
    if os.path.isdir(location):
        return location
    if os.path.exists(location):
        raise FileNotFoundError(f"{what}: {location!r} is a file; pass the directory that holds it")
    _check_local(location, what, reward, keyword)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(location)
    except Exception as err:  # offline, unknown repo, no permission
        raise FileNotFoundError(_download_advice(what, location, reward, keyword, None, err)) from err


def from_pretrained(loader: Callable[..., Any], location: str, what: str, reward: str, keyword: str, **kwargs) -> Any:
    """``loader(location, **kwargs)`` (a transformers ``from_pretrained``) with the same advice on failure."""
    if not os.path.exists(location):
        _check_local(location, what, reward, keyword)
    try:
        return loader(location, **kwargs)
    except OSError as err:
        raise FileNotFoundError(_download_advice(what, location, reward, keyword, None, err)) from err


def reward_setting(reward: str, keyword: str, value: str) -> str:
    """How to set a reward's constructor argument ``keyword`` to ``value``: in a YAML config and on the command
    line (and the SPO fields for its step-aware model)."""
    if reward in CONFIG_FIELDS:
        checkpoint_field, rest_field = CONFIG_FIELDS[reward]
        if keyword == "checkpoint":
            return f"`{checkpoint_field}: {value}` in the config, or `--{checkpoint_field} {value}`"
        return (
            f'`{rest_field}: {{{keyword}: {value}}}` in the config, or `--{rest_field} \'{{"{keyword}": "{value}"}}\'`'
        )
    return (
        f"`reward_kwargs: {{{reward}: {{{keyword}: {value}}}}}` in the config, or "
        f'`--reward_kwargs \'{{"{reward}": {{"{keyword}": "{value}"}}}}\'` on the command line'
    )


def _check_local(location: str, what: str, reward: str, keyword: str) -> None:
    """A ``location`` that cannot be a Hub repository id is a local path that does not exist: say so, without
    download advice."""
    if not _REPO_ID.match(location) or location.startswith((".", "~")) or location.endswith(_WEIGHT_FILES):
        raise FileNotFoundError(
            f"{what}: no such file or directory {location!r} (a local path: check it; it was given as {keyword!r}, "
            f"set with {reward_setting(reward, keyword, 'PATH')})"
        )


def _download_advice(what: str, location: str, reward: str, keyword: str, filename: str | None, err: Exception) -> str:
    target = f"{location} {filename}" if filename else location
    local = f"DIR/{filename}" if filename else "DIR"
    return (
        f"{what} not found: {location!r} is not a local path and could not be fetched from the Hugging Face Hub "
        f"({type(err).__name__}). On a machine with network access run `hf download {target} --local-dir DIR`, "
        f"copy DIR here, then point the reward at it: {reward_setting(reward, keyword, local)}."
    )


class RewardModel(ABC):
    """A reward that owns a model: ``reward(prompts, images) -> list[float]``, the trainer's reward signature.

    The model is loaded lazily, once per process, on the device of the first images it scores (the accelerator's
    device), in ``dtype``; scoring runs under ``torch.no_grad`` in chunks of ``batch_size``. :meth:`score` is the
    differentiable path on tensors (for reward-gradient methods); ``__call__`` converts images the way the
    reference scorer does (8-bit RGB, its own resize/crop/normalise).

    Subclasses implement :meth:`_load` and :meth:`_score` and set ``name``.
    """

    name: str = "reward_model"
    accepts_video: bool = False  # True: scores whole videos (B, F, 3, H, W) instead of images (B, 3, H, W)

    def __init__(self, dtype: torch.dtype | str = torch.float32, batch_size: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.batch_size = batch_size
        self.device: torch.device | None = None
        self._lock = threading.Lock()  # rewards may be scored from the trainer's worker thread
        self.__name__ = self.name  # the trainer logs rewards under their function name

    @property
    def compute_dtype(self) -> torch.dtype:
        """Where scores are computed and returned: float32, or float64 for a float64 model (gradient checks)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def load(self, device: torch.device | str) -> RewardModel:
        """Load the model onto ``device`` unless it is already there."""
        device = torch.device(device)
        with self._lock:
            if self.device != device:
                self._load(device)
                self.device = device
        return self

    @abstractmethod
    def _load(self, device: torch.device) -> None:
        """Build the model(s) on ``device`` in ``self.dtype``, in eval mode, without gradients on parameters."""

    @abstractmethod
    def _score(self, prompts: list[str], images: torch.Tensor, exact: bool) -> torch.Tensor:
        """(B,) scores (:attr:`compute_dtype`) of (B, 3, H, W) images in [0, 1] on ``self.device``; ``exact``:
        convert as the reference does (8-bit, PIL resampling), otherwise differentiably on tensors."""

    def score(self, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
        """Differentiable scores (B,) of images (B, 3, H, W) in [0, 1]; gradients flow to ``images`` (torch
        preprocessing: antialiased bicubic resize, no 8-bit rounding)."""
        self._check(prompts, images)
        self.load(images.device)
        return self._score(list(prompts), images, exact=False)

    def _check(self, prompts: list[str], images: torch.Tensor) -> None:
        if not self.accepts_video:
            check_images(prompts, images, self.name)
            return
        if not isinstance(images, torch.Tensor) or images.ndim != 5:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"{self.name}: videos must be a tensor of shape (B, F, 3, H, W), got {shape}")
        if isinstance(prompts, str) or len(prompts) != images.shape[0]:
            count = "a string" if isinstance(prompts, str) else len(prompts)
            raise ValueError(f"{self.name}: got {count} prompts for {images.shape[0]} videos; pass one per video")
        check_images([p for p in prompts for _ in range(images.shape[1])], images.flatten(0, 1), self.name)

    @torch.no_grad()
    def __call__(self, prompts: list[str], images: torch.Tensor, **_) -> list[float]:
        self._check(prompts, images)
        self.load(images.device)
        return self._in_batches(lambda chunk, pixels: self._score(chunk, pixels, exact=True), prompts, images)

    def _in_batches(
        self, score: Callable[..., torch.Tensor], prompts: list[str], samples: torch.Tensor
    ) -> list[float]:
        """``score(prompts, samples)`` over chunks of ``batch_size``, as B floats."""
        prompts = list(prompts)
        scores = [
            score(prompts[start : start + self.batch_size], samples[start : start + self.batch_size])
            for start in range(0, len(prompts), self.batch_size)
        ]
        return torch.cat(scores).float().cpu().tolist()
