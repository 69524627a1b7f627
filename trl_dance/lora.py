"""LoRA through diffusers' PEFT integration, saved in the format ``Pipeline.load_lora_weights`` reads."""

from __future__ import annotations

import os

import safetensors
import safetensors.torch
import torch
from diffusers import DiffusionPipeline
from diffusers.loaders.lora_base import LoraBaseMixin
from huggingface_hub import ModelCard
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def add_lora(denoiser: torch.nn.Module, peft_config: LoraConfig) -> torch.nn.Module:
    """Freeze ``denoiser`` and add a trainable LoRA adapter (diffusers' ``add_adapter``; stays a ``ModelMixin``)."""
    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}")
    if peft_config.lora_dropout:
        # Dropout makes the policy itself random: the recomputed log-prob would differ from the rollout's, and
        # the PPO ratio would not be 1 on-policy.
        raise ValueError(f"lora_dropout must be 0 for policy-gradient training, got {peft_config.lora_dropout}")
    denoiser.requires_grad_(False)
    denoiser.add_adapter(peft_config)
    return denoiser


def has_lora(denoiser: torch.nn.Module) -> bool:
    return bool(getattr(denoiser, "_hf_peft_config_loaded", False))


def save_lora(
    pipeline_class: type[DiffusionPipeline],
    denoiser_name: str,
    denoiser: torch.nn.Module,
    output_dir: str,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``pytorch_lora_weights.safetensors`` (+ adapter metadata, so ``lora_alpha != r`` reloads at the right
    scale) for ``pipeline_class.load_lora_weights(output_dir)``.

    Keys stay in PEFT's naming under the ``<denoiser_name>.`` prefix, which ``load_lora_weights`` reads for UNets and
    transformers alike; converting a UNet's keys to the old diffusers naming loses ``proj_out`` layers on reload.

    Args:
        pipeline_class: e.g. ``FluxPipeline``; its ``save_lora_weights`` writes the file.
        denoiser_name: the LoRA key prefix, ``"transformer"`` or ``"unet"``.
        denoiser: the unwrapped denoiser carrying the adapter.
        state_dict: a full state dict of the denoiser to take the LoRA weights from (e.g. gathered by DeepSpeed);
            defaults to the denoiser's own.
    """
    layers = get_peft_model_state_dict(denoiser, state_dict=state_dict)
    layers = {key: value.detach().to("cpu").contiguous() for key, value in layers.items()}
    metadata = denoiser.peft_config["default"].to_dict()
    if not hasattr(pipeline_class, "save_lora_weights"):
        # A pipeline without diffusers' LoRA loader (HunyuanVideo 1.5 in 0.42.1): the same file, which the denoiser's
        # load_lora_adapter reads (see load_lora_into_pipeline).
        LoraBaseMixin._save_lora_weights(
            output_dir, {denoiser_name: layers}, {denoiser_name: metadata}, safe_serialization=True
        )
        return
    pipeline_class.save_lora_weights(
        output_dir,
        **{f"{denoiser_name}_lora_layers": layers, f"{denoiser_name}_lora_adapter_metadata": metadata},
        safe_serialization=True,
    )


def lora_loading_code(pipeline_class: type[DiffusionPipeline], denoiser_name: str, lora_name: str, path: str) -> str:
    """The line that loads a LoRA saved by :func:`save_lora` into ``pipeline`` (for model cards)."""
    if not hasattr(pipeline_class, "load_lora_weights"):
        return (
            f"pipeline.{denoiser_name}.load_lora_adapter({path!r}, weight_name={LORA_WEIGHTS_NAME!r}, "
            f"prefix={lora_name!r})"
        )
    # A LoRA of Wan 2.2's second expert is saved under "transformer" and loaded with load_into_transformer_2.
    into = f", load_into_{denoiser_name}=True" if denoiser_name != lora_name else ""
    return f"pipeline.load_lora_weights({path!r}{into})"


def check_lora_fits(denoiser: torch.nn.Module, lora_name: str, directory: str) -> None:
    """Raise ``ValueError`` unless every layer of the LoRA in ``directory`` (keys ``<lora_name>.<module>.lora_A/B``)
    adapts a module of ``denoiser`` with the same input and output sizes: a LoRA of another model (an SD3 LoRA on a
    FLUX base) would otherwise load with a peft warning and change nothing it was trained for. The error names the
    base model the LoRA's card gives."""
    path = os.path.join(directory, LORA_WEIGHTS_NAME)
    modules = dict(denoiser.named_modules())
    prefix, unfit = f"{lora_name}.", []
    with safetensors.safe_open(path, framework="pt") as handle:
        names = handle.keys()
        keys = [key for key in names if key.startswith(prefix) and ".lora_" in key]
        for key in keys:
            name, part = key[len(prefix) :].split(".lora_", 1)
            module, shape = modules.get(name), handle.get_slice(key).get_shape()
            weight = getattr(module, "weight", None)
            if weight is None:
                unfit.append(name)
            elif (
                part.startswith("A")
                and shape[1] != weight.shape[1]
                or part.startswith("B")
                and shape[0] != weight.shape[0]
            ):
                unfit.append(f"{name} (sizes {tuple(shape)} against {tuple(weight.shape)})")
    if keys and not unfit:
        return
    card = os.path.join(directory, "README.md")
    base = ModelCard.load(card).data.base_model if os.path.isfile(card) else None
    trained = f" (its card names the base model {base!r})" if base else ""
    what = f"its layers {sorted(set(unfit))[:3]} are not" if keys else f"it has no {prefix!r} layers, which are"
    raise ValueError(
        f"the LoRA in {directory} was not trained for this {type(denoiser).__name__}{trained}: {what} this "
        "model's; pass the base model it was trained on"
    )


def load_lora_into_pipeline(pipeline: DiffusionPipeline, denoiser_name: str, lora_name: str, directory: str) -> None:
    """Load a LoRA saved by :func:`save_lora` into ``pipeline``'s denoiser ``denoiser_name`` (the file's key prefix
    is ``lora_name``), with the pipeline's ``load_lora_weights`` where it has one, after :func:`check_lora_fits`."""
    check_lora_fits(getattr(pipeline, denoiser_name), lora_name, directory)
    if not hasattr(pipeline, "load_lora_weights"):
        denoiser = getattr(pipeline, denoiser_name)
        denoiser.load_lora_adapter(directory, weight_name=LORA_WEIGHTS_NAME, prefix=lora_name)
        return
    into = {f"load_into_{denoiser_name}": True} if denoiser_name != lora_name else {}
    pipeline.load_lora_weights(directory, **into)


def unload_lora_from_pipeline(pipeline: DiffusionPipeline, denoiser_name: str) -> None:
    """Undo :func:`load_lora_into_pipeline`."""
    if hasattr(pipeline, "unload_lora_weights"):
        pipeline.unload_lora_weights()
    else:
        getattr(pipeline, denoiser_name).unload_lora()


def load_lora(denoiser_name: str, denoiser: torch.nn.Module, directory: str) -> None:
    """Load weights written by :func:`save_lora` back into the adapter ``denoiser`` already carries (resuming).

    Raises:
        FileNotFoundError if ``directory`` has no LoRA file; ValueError if the adapter's keys do not match.
    """
    path = os.path.join(directory, LORA_WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {LORA_WEIGHTS_NAME} in {directory}")
    prefix = f"{denoiser_name}."
    layers = {k[len(prefix) :]: v for k, v in safetensors.torch.load_file(path).items() if k.startswith(prefix)}
    expected = set(get_peft_model_state_dict(denoiser))
    if set(layers) != expected:
        missing, unexpected = sorted(expected - set(layers)), sorted(set(layers) - expected)
        raise ValueError(
            f"LoRA in {directory} does not match the adapter: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    set_peft_model_state_dict(denoiser, layers)
