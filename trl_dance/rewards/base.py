"""The reward-function protocol, lookup by name or import path, and validated scoring."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..video import frame_indices

RewardFunc = Callable[..., Sequence[float | None]]
"""``f(prompts: list[str], images: Tensor (B, 3, H, W) float in [0, 1], **columns) -> B floats (or None)``.

TRL's naming works too: the samples also arrive as ``completions`` (the same tensor), so ``def f(completions,
**kwargs)`` written for ``trl.GRPOTrainer`` is called as it is. A function without ``**kwargs`` receives only the
arguments it names. As in TRL, a reward may abstain on a row it does not apply to by returning None there: the
weighted sum of the rewards skips it, and a row no reward scores is an error. NaN is an error naming the reward (what
a broken scorer returns; TRL would read it as an abstention). The trainers also pass ``trainer_state`` (the
``transformers.TrainerState``) and ``log_metric(name, value)`` (a scalar averaged per log) as keyword arguments.

Attributes a function may set: ``accepts_video = True`` scores videos whole (``images`` is then (B, F, 3, H, W); any
other function scores videos frame by frame, see :func:`score_images`); ``groupwise = True`` is called once per
group with the G samples of one prompt (e.g. a pairwise judge's win rates); ``accepts_audio = True`` also receives the
samples' soundtracks, from families that generate them (LTX-2), as ``audio`` ((B, channels, samples) float waveforms)
and ``audio_sample_rate`` (Hz), with the videos whole, as a CLAP-style audio-text scorer needs; ``modality =
"video" | "audio" | "both"`` says what the reward judges on audio-video families, whose streams then train on the
advantages of their own rewards (OmniNFT's routing; ``reward_modalities`` in the config overrides it; default
``"both"``)."""

MODALITIES = ("video", "audio", "both")
"""What a reward may judge of an audio-video sample (``modality``)."""


def reward_modality(func: RewardFunc, given: str | None = None) -> str:
    """The modality ``func`` judges: ``given`` (the config's), else its ``modality`` attribute, else ``"both"``."""
    modality = given or getattr(func, "modality", "both")
    if modality not in MODALITIES:
        raise ValueError(f"reward {reward_name(func)!r}: modality must be one of {MODALITIES}, got {modality!r}")
    return modality


def _registry() -> dict[str, Callable[..., Any]]:
    """Registered names: pixel rewards are plain functions; model rewards are classes built with ``kwargs``."""
    from . import (
        aesthetic,
        audio,
        clip,
        hps,
        hpsv3,
        image_reward,
        judges,
        llava_bertscore,
        ocr,
        pickle_servers,
        pixel,
        video_align,
    )

    return {
        "brightness": pixel.brightness,
        "jpeg_compressibility": pixel.jpeg_compressibility,
        "jpeg_incompressibility": pixel.jpeg_incompressibility,
        "temporal_consistency": pixel.temporal_consistency,
        "hpsv2": hps.HPSv2Reward,
        "hpsv3": hpsv3.HPSv3Reward,
        "videoalign": video_align.VideoAlignReward,
        "image_reward": image_reward.ImageReward,
        "pickscore": clip.PickScore,
        "clip_score": clip.CLIPScore,
        "clap": audio.CLAPScore,
        "av_sync": audio.av_sync,
        "aesthetic": aesthetic.AestheticReward,
        "ocr": ocr.OCRReward,
        "ocr_easyocr": ocr.EasyOCRJudge,
        "vlm_judge": judges.PointwiseJudge,
        "pairwise_judge": judges.PairwiseJudge,
        "llava_bertscore": pickle_servers.LLaVABertScore,
        "llava_bertscore_local": llava_bertscore.LLaVABertScoreLocal,
        "deqa": pickle_servers.DeQAReward,
        "geneval": pickle_servers.GenEvalReward,
    }


def get_reward_function(spec: str | RewardFunc, **kwargs: Any) -> RewardFunc:
    """Resolve a reward: a callable (returned as is), a registered name (``"hpsv2"``), ``"module.path:func"``,
    ``"module.path.func"`` (the dotted form TRL's GRPO script takes), or a URL (``"http://host:port"``: a
    :class:`~trl_dance.rewards.remote.RemoteReward`, ``kwargs`` its options).

    Args:
        kwargs: constructor arguments of a registered model reward (checkpoint paths, dtype, batch size), e.g.
            ``get_reward_function("hpsv2", checkpoint="/ckpt/HPS_v2.1_compressed.pt")``.
    """
    if callable(spec):
        if kwargs:
            raise ValueError(f"reward arguments {sorted(kwargs)} given for an already built reward {spec!r}")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a reward must be a callable, a registered name or 'module:function', got {type(spec)}")
    if spec.startswith(("http://", "https://")):
        from .remote import RemoteReward

        return RemoteReward(spec, **kwargs)
    registry = _registry()
    if spec in registry:
        entry = registry[spec]
        if isinstance(entry, type):
            return entry(**kwargs)
        if kwargs:
            raise ValueError(f"reward {spec!r} takes no arguments, got {sorted(kwargs)}")
        return entry
    if ":" in spec or "." in spec:
        module_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if os.getcwd() not in sys.path:  # `my_rewards:fn` beside the user, as a script run there imports it
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise ValueError(f"reward {spec!r}: cannot import {module_name!r} ({error})") from error
        func = getattr(module, attr, None)
        if not callable(func):
            raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
        return func(**kwargs) if isinstance(func, type) else func
    raise ValueError(
        f"unknown reward {spec!r}; registered rewards: {sorted(registry)}, or pass 'module.path:function' or "
        "'module.path.function'"
    )


def resolve_reward_funcs(
    reward_funcs: RewardFunc | str | Sequence[RewardFunc | str],
    reward_kwargs: dict[str, dict[str, Any]] | None = None,
    columns: Sequence[str] | None = None,
) -> list[RewardFunc]:
    """A trainer's ``reward_funcs`` (one reward or a list, as :func:`get_reward_function` takes them) as a list of
    callables, each signature checked against what trainers pass (:func:`check_reward_signature`, with the dataset's
    ``columns`` when known) and each remote one probed (``probe()``: something must answer at its address);
    ``reward_kwargs`` gives registered names their constructor arguments."""
    reward_kwargs = reward_kwargs or {}
    if reward_funcs is None or (
        isinstance(reward_funcs, Sequence) and not isinstance(reward_funcs, str) and not reward_funcs
    ):
        raise ValueError("at least one reward function is required")
    if isinstance(reward_funcs, str) or callable(reward_funcs):
        reward_funcs = [reward_funcs]
    unused = set(reward_kwargs) - {func for func in reward_funcs if isinstance(func, str)}
    if unused:
        raise ValueError(f"reward_kwargs names rewards that are not in reward_funcs: {sorted(unused)}")
    funcs = [
        get_reward_function(func, **(reward_kwargs.get(func, {}) if isinstance(func, str) else {}))
        for func in reward_funcs
    ]
    for func in funcs:
        check_reward_signature(func, columns)
    for func in funcs:
        if callable(getattr(func, "probe", None)):
            func.probe()
    return funcs


# What a trainer passes every reward by keyword, beside the dataset's columns.
REWARD_ARGUMENTS = ("prompts", "images", "completions", "trainer_state", "log_metric")
# What it passes rewards with ``accepts_audio = True`` besides.
AUDIO_ARGUMENTS = ("audio", "audio_sample_rate")


def _parameters(func: RewardFunc) -> tuple[list[inspect.Parameter], bool] | None:
    """``func``'s parameters and whether it takes ``**kwargs``; None when Python cannot read its signature."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # builtins and C extensions: checked at their first call
        return None
    return parameters, any(p.kind is p.VAR_KEYWORD for p in parameters)


def check_reward_signature(func: RewardFunc, columns: Sequence[str] | None = None) -> None:
    """Raise before any model work if ``func`` cannot be called as trainers call it: by keyword with
    :data:`REWARD_ARGUMENTS` and the dataset's ``columns`` (``None``: not known, any other required name is taken to
    be a column).

    Raises:
        ValueError naming the reward and the parameter it would miss.
    """
    read = _parameters(func)
    if read is None:
        return
    parameters, takes_kwargs = read
    name = reward_name(func)
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ValueError(f"reward {name!r}: rewards are called by keyword; make {positional} ordinary parameters")
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not takes_kwargs and not named & {"images", "completions"}:
        raise ValueError(
            f"reward {name!r} takes neither `images` nor TRL's `completions` (the generated images or videos, "
            "(B, 3, H, W) or (B, F, 3, H, W) float in [0, 1]), nor **kwargs: it would never see a sample"
        )
    available = set(REWARD_ARGUMENTS) | set(columns or ())
    if getattr(func, "accepts_audio", False):
        if not takes_kwargs and "audio" not in named:
            raise ValueError(f"reward {name!r} sets accepts_audio but takes neither `audio` nor **kwargs")
        available |= set(AUDIO_ARGUMENTS)
    required = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in available
    ]
    if required and columns is not None:
        hint = " (TRL's token ids: image and video samples have none)" if "completion_ids" in required else ""
        raise ValueError(
            f"reward {name!r} requires {required}{hint}, which no trainer passes: rewards receive "
            f"{list(REWARD_ARGUMENTS)} and the dataset's columns {sorted(columns)}; give those parameters a default"
        )


def registered_rewards() -> list[str]:
    """Names accepted by :func:`get_reward_function` and in ``reward_funcs`` of a config."""
    return sorted(_registry())


def reward_name(func: RewardFunc) -> str:
    """The name a reward is logged under: ``rewards/<name>/mean``."""
    return getattr(func, "__name__", None) or type(func).__name__


class RewardError(ValueError):
    """A reward function raised: names the function, the exception and the line it came from, what was being scored
    and the first prompts (``where``, e.g. the round, is prefixed by the caller)."""

    def __init__(self, name: str, error: Exception, scoring: str, prompts: Sequence[str], where: str = ""):
        import traceback

        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
        self.name, self.error, self.scoring, self.prompts, self.where = name, error, scoring, list(prompts), where
        super().__init__(
            f"{where}reward {name!r} raised {type(error).__name__}: {error}{at}, scoring {scoring} (first prompts "
            f"{list(prompts[:2])!r})"
        )

    def at(self, where: str) -> RewardError:
        """The same error, said to have happened ``where`` (``"round 3: "``)."""
        other = RewardError(self.name, self.error, self.scoring, self.prompts, where)
        return other.with_traceback(self.__traceback__)


def score_images(
    funcs: Sequence[RewardFunc],
    prompts: list[str],
    images: torch.Tensor,
    columns: dict[str, list[Any]],
    video_frames: int | None = None,
    groups: Sequence[int] | None = None,
    extra: dict[str, Any] | None = None,
    audio: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Call every reward function on one batch and validate what it returns.

    Args:
        images: (B, 3, H, W) images or (B, F, 3, H, W) videos, float in [0, 1].
        video_frames: for videos, a reward without ``accepts_video = True`` scores this many evenly spaced frames of
            each video (first and last included; ``None``: every frame) as images, prompt and columns repeated, and
            the video's reward is their mean. A reward with ``accepts_video = True`` gets the videos.
        groups: B group ids, equal and contiguous within a group; a ``groupwise`` reward is called once per run of
            equal ids (default: the whole batch is one group).
        extra: keyword arguments for every function beside the columns (``trainer_state``, ``log_metric``).
        audio: the samples' soundtracks (B, channels, samples) and their sample rate, for rewards with
            ``accepts_audio = True`` (which score whole samples).

    Returns:
        (B, F) float32 on ``images.device``, one column per function; NaN where a function abstained.

    Raises:
        ValueError naming the function if it returns the wrong number of values, non-numbers, or ±inf.
    """
    extra = extra or {}
    columns_out = []
    for func in funcs:
        if getattr(func, "accepts_audio", False):
            if audio is None:
                raise ValueError(f"reward {reward_name(func)!r} scores audio, and this model generates none")
            sound = dict(zip(AUDIO_ARGUMENTS, audio))
            values = _call(func, prompts, images, columns, extra | sound, unit="samples")
        elif images.ndim == 5 and not getattr(func, "accepts_video", False):
            if getattr(func, "groupwise", False):
                raise ValueError(
                    f"group-wise reward {reward_name(func)!r} scores videos only with accepts_video = True"
                )
            frames = frame_indices(images.shape[1], video_frames)
            count = len(frames)
            values = _call(
                func,
                [p for p in prompts for _ in range(count)],
                images[:, frames].flatten(0, 1),
                {key: [v for v in column for _ in range(count)] for key, column in columns.items()},
                extra,
                unit=f"frames ({count} per video)",
            )
            values = values.view(-1, count).nanmean(dim=1)
        elif getattr(func, "groupwise", False):
            runs = _runs(groups if groups is not None else [0] * len(prompts))
            values = torch.cat(
                [
                    _call(
                        func,
                        prompts[a:b],
                        images[a:b],
                        {key: column[a:b] for key, column in columns.items()},
                        extra,
                        unit="samples of a group",
                    )
                    for a, b in runs
                ]
            )
        else:
            values = _call(func, prompts, images, columns, extra, unit="videos" if images.ndim == 5 else "images")
        columns_out.append(values)
    return torch.stack(columns_out, dim=1).to(images.device)


def _runs(groups: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal consecutive ids."""
    runs, start = [], 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i] != groups[start]:
            runs.append((start, i))
            start = i
    return runs


def _call(
    func: RewardFunc,
    prompts: list[str],
    images: torch.Tensor,
    columns: dict[str, list[Any]],
    extra: dict[str, Any],
    unit: str,
) -> torch.Tensor:
    """(len(prompts),) float32 CPU values of one reward function, validated; None becomes NaN (abstained)."""
    name, batch = reward_name(func), images.shape[0]
    arguments = {"prompts": prompts, "images": images, "completions": images, **columns, **extra}
    read = _parameters(func)
    if read is not None and not read[1]:  # no **kwargs: only what it names
        named = {p.name for p in read[0]}
        arguments = {key: value for key, value in arguments.items() if key in named}
    try:
        values = func(**arguments)
    except (RewardError, torch.OutOfMemoryError, MemoryError):  # (out of memory is named by the trainer's phase)
        raise
    except Exception as err:  # the user's code: named, with where it failed and what it was scoring
        raise RewardError(name, err, f"{batch} {unit}", prompts) from err
    if isinstance(values, torch.Tensor):
        values = values.detach().flatten().tolist()
    try:
        values = list(values)
        abstained = torch.tensor([v is None for v in values], dtype=torch.bool)
        values = [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"reward function {name!r} must return {batch} numbers (or None), got {values!r:.200}"
        ) from err
    if len(values) != batch:
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {batch} {unit}")
    # Checked in the dtype training uses: 1e300 is a finite float64 but inf in float32.
    tensor = torch.tensor(values, dtype=torch.float32)
    bad = (~torch.isfinite(tensor) & ~abstained).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"reward function {name!r} returned values that are NaN or infinite in float32 at positions {bad[:10]} "
            f"of {batch} {unit}: {[values[i] for i in bad[:10]]} (return None to abstain on a row)"
        )
    return tensor


def weighted_reward_sum(
    scores: torch.Tensor, weights: torch.Tensor, prompts: Sequence[str] | None = None
) -> torch.Tensor:
    """(B,) the weighted sum of the (B, F) rewards over those that scored each row (abstentions are skipped).

    Raises:
        ValueError naming the first row (and its prompt, when given) that no reward scored.
    """
    unscored = torch.isnan(scores).all(dim=1)
    if unscored.any():
        row = int(unscored.nonzero()[0])
        prompt = f" (prompt {prompts[row]!r:.100})" if prompts is not None else ""
        raise ValueError(
            f"no reward scored sample {row}{prompt}: every reward function abstained (returned None/NaN); at least one "
            "must score each sample"
        )
    return (scores * weights.to(scores)).nansum(dim=1)
