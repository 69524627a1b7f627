"""OmniNFT's layer-wise gradient surgery (arXiv 2605.12480, ALGORITHMS-NEXT §2.17.5): the gradient that LTX-2's
audio→video cross-attention sends back into the audio stream, scaled per block by a straight-through identity
(the forward is unchanged), so that video rewards shape the audio stream less in the blocks where that hurts sync."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class GradientSurgeryArguments:
    r"""
    Parameters:
        audio_to_video_gradient_scales (`dict[str, float]` or `None`, defaults to `None`): OmniNFT's layer-wise
            gradient surgery on LTX-2 (`ca_kv_scale_a2v`): per block of the denoiser (a key `"7"` or an inclusive range
            `"1-10"`), the factor s by which the audio→video cross-attention scales the gradient it sends into the
            audio stream through its keys and values, y = sg(x) + s·(x − sg(x)) (the forward is unchanged). Blocks not
            named keep 1. OmniNFT's: `{"0": 0, "1-10": 0.1, "40-47": 0.3}` (48 blocks). On the command line, a JSON
            object. `None`: no surgery.
    """

    audio_to_video_gradient_scales: dict[str, float] | str | None = field(
        default=None,
        metadata={"help": 'LTX-2: per-block scale of the audio K/V gradient of the a2v attention, e.g. {"0": 0}.'},
    )

    def _check_gradient_surgery(self) -> None:
        spec = self.audio_to_video_gradient_scales  # (a JSON object on the command line: TRL's dict fields parse it)
        if spec is None:
            return
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"audio_to_video_gradient_scales must map blocks to scales (on the command line a JSON object, e.g. "
                f'{{"0": 0}}), got {spec!r}'
            )
        block_scales(spec)


def block_scales(spec: Mapping[str, float], num_blocks: int | None = None) -> dict[int, float]:
    """``{"0": 0, "1-10": 0.1}`` → ``{0: 0.0, 1: 0.1, …, 10: 0.1}``: each key a block index or an inclusive range
    ``"a-b"``, each value finite and >= 0; a ValueError for anything else, a block named twice, or (given
    ``num_blocks``) one past the last."""
    scales: dict[int, float] = {}
    for key, value in spec.items():
        low, _, high = str(key).partition("-")
        if not low.strip().isdigit() or (high and not high.strip().isdigit()):
            raise ValueError(f"audio_to_video_gradient_scales: {key!r} is not a block index or a range 'first-last'")
        first, last = int(low), int(high or low)
        if first > last:
            raise ValueError(f"audio_to_video_gradient_scales: the range {key!r} is empty")
        if not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"audio_to_video_gradient_scales[{key!r}] must be a finite number >= 0, got {value!r}")
        for block in range(first, last + 1):
            if block in scales:
                raise ValueError(f"audio_to_video_gradient_scales names block {block} twice")
            scales[block] = float(value)
    if num_blocks is not None and scales and max(scales) >= num_blocks:
        raise ValueError(
            f"audio_to_video_gradient_scales names block {max(scales)}, but the denoiser has {num_blocks} blocks"
        )
    return scales


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in value (bit for bit), its gradient times ``scale``: sg(x) + s·(x − sg(x))."""
    if scale == 0:
        return x.detach()
    return x.detach() + scale * (x - x.detach())


def install_audio_to_video_surgery(denoiser: torch.nn.Module, spec: Mapping[str, float]) -> None:
    """Scale the audio-side key/value gradient of each block's ``audio_to_video_attn`` of ``denoiser`` (LTX-2) as
    ``spec`` says (:func:`block_scales`), by forward pre-hooks on those modules, kept for the model's lifetime.
    Install before the denoiser's first call: a compiled block traces the hooks it has at its first call."""
    blocks = getattr(denoiser, "transformer_blocks", None)
    if not blocks or not all(hasattr(block, "audio_to_video_attn") for block in blocks):
        raise ValueError(
            f"audio_to_video_gradient_scales needs LTX-2's audio→video cross-attention; {type(denoiser).__name__} "
            "has none"
        )
    for index, scale in block_scales(spec, len(blocks)).items():
        if scale != 1:
            blocks[index].audio_to_video_attn.register_forward_pre_hook(_KeyValueGradient(scale), with_kwargs=True)


class _KeyValueGradient:
    """The pre-hook: the attention's ``encoder_hidden_states`` (the audio keys and values) through :func:`scale_gradient`."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, module, args, kwargs):
        if "encoder_hidden_states" not in kwargs:
            raise RuntimeError("LTX-2's audio→video attention was called without encoder_hidden_states by keyword")
        return args, kwargs | {"encoder_hidden_states": scale_gradient(kwargs["encoder_hidden_states"], self.scale)}


__all__ = ["GradientSurgeryArguments", "block_scales", "install_audio_to_video_surgery"]
