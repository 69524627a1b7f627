"""Memory settings of the frozen pipeline components (VAE, text encoders), shared by both trainers' configs."""

from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class FrozenComponentsArguments:
    r"""
    Parameters:
        frozen_dtype (`str` or `None`, defaults to `None`): Cast the VAE and text encoders to `"bfloat16"` or
            `"float16"` (T5-XXL: 19 GB in float32, 9.5 GB in bf16) while the denoiser keeps its own dtype. `None`:
            leave them as loaded.
        offload_text_encoders (`bool`, defaults to `False`): Keep the text encoders on the CPU and move them to the
            accelerator only while encoding. GRPO encodes once per round (its distinct prompts), so this costs one
            transfer per round; Diffusion-DPO encodes every step, where it costs one per step.
    """

    frozen_dtype: str | None = field(
        default=None,
        metadata={"help": "dtype of the VAE and text encoders (bfloat16 | float16 | float32).", "choices": _DTYPES},
    )
    offload_text_encoders: bool = field(
        default=False, metadata={"help": "Keep the text encoders on the CPU except while encoding."}
    )

    def _check_frozen_components(self) -> None:
        if self.frozen_dtype is not None and self.frozen_dtype not in _DTYPES:
            raise ValueError(f"frozen_dtype must be one of {_DTYPES} or None, got {self.frozen_dtype!r}")
