"""Rollout images, prompts and rewards, and a reward histogram, sent to the trackers the Trainer reports to.

The Trainer's own integration callbacks own the trackers (``report_to``); this module only finds their writers,
so images land in the same TensorBoard run / W&B run / trackio project as the scalar metrics.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
from transformers.integrations import TensorBoardCallback, TrackioCallback, WandbCallback

from ..video import frame_strip
from ..visualization import to_pil

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
"""The trackers the recipes document (``report_to``) and the package each needs: the ``tracking`` extra."""


def check_trackers(report_to: Sequence[str]) -> None:
    """Refuse a named tracker whose package is missing, naming the extra (transformers raises a RuntimeError from its
    callback's constructor, after the model has loaded)."""
    import importlib.util

    missing = [
        name for name in report_to if name in TRACKER_PACKAGES and not importlib.util.find_spec(TRACKER_PACKAGES[name])
    ]
    if missing:
        packages = " ".join(TRACKER_PACKAGES[name] for name in missing)
        raise ValueError(
            f"report_to {', '.join(missing)} needs {packages}: pip install 'trl-dance[tracking]' (or {packages}), "
            "or report_to none"
        )


class DiffusersTensorBoardCallback(TensorBoardCallback):
    """transformers' TensorBoard callback for a diffusers denoiser, whose ``config`` is a ``FrozenDict`` without the
    ``to_json_string`` the stock callback calls at the start of training."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.tb_writer is not None and model is not None and isinstance(getattr(model, "config", None), dict):
            self.tb_writer.add_text("model_config", json.dumps(dict(model.config), indent=2, default=str))


def use_diffusers_callbacks(callback_handler) -> None:
    """Swap the stock TensorBoard callback (added for ``report_to``) for :class:`DiffusersTensorBoardCallback`."""
    stock = [c for c in callback_handler.callbacks if type(c) is TensorBoardCallback]
    for callback in stock:
        callback_handler.remove_callback(callback)
        callback_handler.add_callback(DiffusersTensorBoardCallback(tb_writer=callback.tb_writer))


def log_rollout_media(
    callbacks: Sequence,
    step: int,
    images: torch.Tensor,
    prompts: list[str],
    rewards: torch.Tensor | None,
    all_rewards: torch.Tensor | None,
    name: str = "completions",
) -> list[str]:
    """Log ``images`` (K, 3, H, W) in [0, 1] (videos (K, F, 3, H, W) as frame strips) captioned with their prompts
    and rewards (K,), and the histogram of ``all_rewards`` (the round's rewards over all processes), at optimizer
    step ``step``, under ``name/`` (``eval/`` for evaluations). Without rewards: the images and prompts only.

    Returns:
        the names of the trackers written to.
    """
    captions = list(prompts)
    if rewards is not None:
        captions = [f"{prompt} | reward {reward:.4f}" for prompt, reward in zip(prompts, rewards.tolist())]
    written = []
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            writer = callback.tb_writer
            strips = frame_strip(images).float().clamp(0, 1).cpu()
            writer.add_images(f"{name}/images", strips, step, dataformats="NCHW")
            writer.add_text(f"{name}/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
            if all_rewards is not None:
                writer.add_histogram(f"{name}/reward", all_rewards.float().cpu(), step)
            writer.flush()
            written.append("tensorboard")
        elif isinstance(callback, WandbCallback) and getattr(callback, "_wandb", None) is not None:
            wandb = callback._wandb
            if wandb.run is not None:
                logged = {f"{name}/images": [wandb.Image(im, caption=c) for im, c in zip(to_pil(images), captions)]}
                if all_rewards is not None:
                    logged[f"{name}/reward"] = wandb.Histogram(all_rewards.float().cpu().numpy())
                wandb.log(logged | {"train/global_step": step})
                written.append("wandb")
        elif isinstance(callback, TrackioCallback) and getattr(callback, "_trackio", None) is not None:
            trackio = callback._trackio
            if hasattr(trackio, "Image"):
                media = [trackio.Image(im, caption=c) for im, c in zip(to_pil(images), captions)]
                trackio.log({f"{name}/image_{i}": m for i, m in enumerate(media)}, step=step)
                written.append("trackio")
    return written
