"""FLOP accounting (trl_dance.flops) against torch's FlopCounterMode, and the perf/* metrics of a run."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from tests.conftest import TINY_VIDEO_FRAMES, tiny_dpo_config, tiny_grpo_config
from trl_dance.flops import DenoiserFlops, torch_flop_counter
from trl_dance.policies import SamplerSettings, make_policy
from trl_dance.testing import TINY_PIPELINES, TINY_RESOLUTION, tiny_condition_images, tiny_preference_dataset
from trl_dance.testing.minimax_h3 import MINIMAX_H3_TINY_FRAMES
from trl_dance.trainer.performance import PerformanceLog, peak_tflops

# Every family's tiny denoiser: a frozen forward with CFG where the family uses it, and a training forward + backward
# with LoRA and activation checkpointing, or fully fine-tuned. Measured: every case within 0.17 % of torch's count
# (Wan I2V's LoRA; the others exact).
CASES = [("frozen", True, False), ("lora", False, True), ("full", False, False)]


def _count(kind: str, mode: str, cfg: bool, checkpointing: bool, **more) -> tuple[float, float]:
    video = kind.startswith(("wan", "hunyuan", "skyreels", "ltx"))
    frames = MINIMAX_H3_TINY_FRAMES if kind == "minimax-h3" else TINY_VIDEO_FRAMES if video else None
    settings = SamplerSettings(
        height=TINY_RESOLUTION,
        width=TINY_RESOLUTION,
        guidance_scale=4.0 if cfg and kind != "minimax-h3" else 1.0,  # (H3 is guidance-distilled, without a scale)
        max_sequence_length=64 if kind.startswith("qwen-image-edit") else 16,  # the source's image tokens
        num_frames=frames,
        **more,
    )
    if kind in ("ltx2-i2v", "ltx2-condition"):  # (its default H.264 re-compression of the image needs PyAV)
        settings.pipeline_kwargs = {**(settings.pipeline_kwargs or {}), "image_crf": 0}
    policy = make_policy(TINY_PIPELINES[kind](0), settings).to("cpu")
    denoiser = policy.denoiser.requires_grad_(mode == "full")
    if mode == "lora":
        denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if checkpointing:
        denoiser.enable_gradient_checkpointing()
        denoiser.train()
    cond = policy.encode_prompts(["a cat", "a dog"], **{c: tiny_condition_images(2) for c in policy.condition_columns})
    latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    if policy.use_cfg:
        policy._negative_cond(2, cond)  # its text encoding is not the denoiser's
    counter = DenoiserFlops(policy.flop_layout, policy.flop_tokens).attach(denoiser)
    with torch_flop_counter(display=False) as torch_count, torch.set_grad_enabled(mode != "frozen"):
        output = policy.predict(denoiser, latents, cond, at=torch.zeros(2, dtype=torch.long))
        if mode != "frozen":
            output.square().mean().backward()
    return counter.take(), torch_count.get_total_flops()


@pytest.mark.parametrize("kind", sorted(TINY_PIPELINES))
def test_closed_form_matches_torch_count(kind, small_edit_sources):
    for mode, cfg, checkpointing in CASES:
        ours, theirs = _count(kind, mode, cfg, checkpointing)
        assert theirs > 0
        assert ours == pytest.approx(theirs, rel=0.005), (mode, cfg, checkpointing)


def test_ltx2_guidance_forwards_are_counted():
    """LTX-2's four forwards a step (CFG's two, STG, modality isolation): STG skips its blocks' self-attention
    queries, keys and cores, isolation the audio↔video attention; counted as torch counts them (1 of 2 blocks
    perturbed here: counting it whole would be 12 % over)."""
    for mode, cfg, checkpointing in CASES:
        ours, theirs = _count(
            "ltx2", mode, cfg, checkpointing, pipeline_kwargs={"spatio_temporal_guidance_blocks": [1]}
        )
        assert ours == pytest.approx(theirs, rel=0.005), (mode, cfg, checkpointing)


def test_cpu_attention_is_counted():
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    with torch_flop_counter(display=False) as forward:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with torch_flop_counter(display=False) as backward:
        out.sum().backward()
    assert forward.get_total_flops() == 4 * 2 * 4 * 64 * 64 * 32
    assert backward.get_total_flops() == 2.5 * forward.get_total_flops()  # torch's count: QKᵀ recomputed


def test_import_leaves_torch_flop_registry_alone():
    """Importing trl_dance (and its trainers) registers nothing in torch's global FLOP table: a program's own
    FlopCounterMode counts as it would without us (the CPU kernel's formulas go to one counter only)."""
    import subprocess
    import sys

    code = (
        "from torch.utils.flop_counter import flop_registry as r; before = dict(r); "
        "import trl_dance, trl_dance.flops, trl_dance.trainer.diffusion_trainer; assert dict(r) == before, set(r) ^ set(before)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    from trl_dance.flops import TORCH_FLOP_FORMULAS

    assert TORCH_FLOP_FORMULAS and not set(TORCH_FLOP_FORMULAS) & set(flop_registry)


def _denoiser_count(counter: FlopCounterMode, model_class: str) -> float:
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name == model_class)


def test_grpo_logs_what_torch_counts(tiny_model_dir, tmp_path):
    """The logged perf/denoiser_tflops of a run (rollouts, old-policy and training forwards, backwards) sum to the
    FLOPs torch counts in the denoiser, and the other perf metrics are there."""
    from trl_dance import DanceGRPOTrainer

    args = tiny_grpo_config(tmp_path, max_steps=2, peak_tflops=1.0)
    dataset = Dataset.from_dict({"prompt": ["a cat", "a dog"] * 4})
    trainer = DanceGRPOTrainer(tiny_model_dir("flux"), "brightness", args=args, train_dataset=dataset)
    with torch_flop_counter(display=False) as counter:
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "perf/denoiser_tflops" in entry]
    assert len(logs) == 2
    logged = sum(entry["perf/denoiser_tflops"] for entry in logs) * 1e12
    assert logged == pytest.approx(_denoiser_count(counter, "FluxTransformer2DModel"), rel=1e-6)
    first = logs[0]
    assert first["perf/mfu"] == pytest.approx(first["perf/tflops_per_s"] / 1.0)
    assert first["perf/samples_per_s"] > 0 and first["perf/time/rollout"] > 0 and first["perf/time/training"] > 0
    assert sum(first[f"perf/time/{p}"] for p in ("rollout", "reward", "training", "other")) == pytest.approx(1.0)
    # Phase MFU: each phase's FLOPs over its own time; the denoiser runs only in rollouts and training, so the phases'
    # MFUs weighted by their time shares give the whole run's.
    for entry in logs:
        weighted = sum(entry[f"perf/mfu/{p}"] * entry[f"perf/time/{p}"] for p in ("rollout", "training"))
        assert weighted == pytest.approx(entry["perf/mfu"], rel=1e-6)
        assert entry["perf/mfu/rollout"] > 0 and entry["perf/mfu/training"] > 0


def test_dpo_logs_what_torch_counts(tiny_model_dir, tmp_path):
    """Diffusion-DPO with LoRA: the reference forwards run with the adapter off, so without LoRA's products."""
    from trl_dance import DiffusionDPOTrainer

    args = tiny_dpo_config(tmp_path, logging_steps=1, per_device_train_batch_size=2)
    peft = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    dataset = tiny_preference_dataset("sd", count=4)
    trainer = DiffusionDPOTrainer(tiny_model_dir("sd"), args=args, train_dataset=dataset, peft_config=peft)
    with torch_flop_counter(display=False) as counter:
        trainer.train()
    logged = sum(entry.get("perf/denoiser_tflops", 0.0) for entry in trainer.state.log_history) * 1e12
    assert logged == pytest.approx(_denoiser_count(counter, "UNet2DConditionModel"), rel=1e-6)


def test_peak_table():
    """TRL's lookup (whole words, per dtype): NVL and PCIe cards get their own peaks, "L40" is not "L4"."""
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 NVL") == 835.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H200 NVL") == 835.0
    assert peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("NVIDIA L40") is None
    assert peak_tflops("NVIDIA L40S") == 362.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("AMD Instinct MI300X") == 1300.0
    assert peak_tflops("NVIDIA GeForce RTX 3090") is None
    assert peak_tflops("NVIDIA T4", "float16") == 65.0 and peak_tflops("NVIDIA T4", "bfloat16") is None
    assert peak_tflops("NVIDIA H100 80GB HBM3", "float32") is None
    assert PerformanceLog(torch.device("cpu"), None).peak is None
