"""Rewards routed per modality (OmniNFT's routing, ALGORITHMS-NEXT §2.17.5) on LTX-2's video and audio streams:
per-stream log-probabilities, per-stream advantages, an audio-only reward leaving the video tokens' gradient exactly
zero (GRPO and NFT), bad input, and a run in which a hidden audio reward rises."""

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    assert_learned,
    family_overrides,
    tiny_grpo_config,
    tiny_online_values,
)
from datasets import Dataset
from peft import LoraConfig

from trl_dance import DanceGRPOTrainer, DiffusionNFTConfig, DiffusionNFTTrainer
from trl_dance.advantages import group_advantages, normalized_reward_sum
from trl_dance.sde import flow_sde_step, join_streams, reduce_per_sample
from trl_dance.testing import tiny_condition_images

# The video unguided (its CFG, STG, modality isolation and rescale off): two forwards a step instead of four.
UNGUIDED = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": 1.0}


def loudness(prompts, images, audio, audio_sample_rate, **_):
    """The soundtrack's RMS: an audio-only reward."""
    return audio.pow(2).mean(dim=(1, 2)).sqrt().tolist()


loudness.accepts_audio = True
loudness.modality = "audio"


def _lora() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")


def _trainer(tiny_model_dir, tmp_path, method="grpo", rewards=(loudness,), **overrides):
    guidance = {"guidance_scale": 3.0, "pipeline_kwargs": {"spatio_temporal_guidance_blocks": [1]}}  # 4 forwards
    values = family_overrides("ltx2") | guidance | {"max_steps": 1} | overrides
    dataset = Dataset.from_dict({"prompt": PROMPTS[:8]})
    if method == "grpo":  # 2 of the 5 steps of each sample: 2 micro-batches
        args = tiny_grpo_config(tmp_path, **({"timestep_fraction": 0.4, "gradient_accumulation_steps": 2} | values))
        trainer_class = DanceGRPOTrainer
    else:
        values = tiny_online_values(tmp_path) | {"timestep_fraction": 0.5, "gradient_accumulation_steps": 3} | values
        args, trainer_class = DiffusionNFTConfig(**values), DiffusionNFTTrainer
    return trainer_class(tiny_model_dir("ltx2"), list(rewards), args=args, train_dataset=dataset, peft_config=_lora())


def test_stream_log_probs_give_back_the_joint_one():
    """Per-stream log-probabilities (B, S) are each stream's reduction over its own elements, and
    :func:`join_streams` gives back the one-stream reduction, for the mean and the sum."""
    generator = torch.Generator().manual_seed(0)
    v, x = torch.randn(3, 10, generator=generator), torch.randn(3, 10, generator=generator)
    joint = flow_sde_step(v, x, 0.8, 0.6, eta=0.5, generator=torch.Generator().manual_seed(1))
    for reduction in ("mean", "sum"):
        whole = flow_sde_step(v, x, 0.8, 0.6, eta=0.5, prev_sample=joint.prev_sample, reduction=reduction)
        split = flow_sde_step(
            v, x, 0.8, 0.6, eta=0.5, prev_sample=joint.prev_sample, reduction=reduction, segments=(7, 3)
        )
        assert split.log_prob.shape == (3, 2)
        torch.testing.assert_close(join_streams(split.log_prob, (7, 3), reduction), whole.log_prob)
    values = torch.arange(12.0).view(2, 6)
    torch.testing.assert_close(reduce_per_sample(values, "mean", (4, 2)), torch.tensor([[1.5, 4.5], [7.5, 10.5]]))
    torch.testing.assert_close(reduce_per_sample(values, "sum", (4, 2)), torch.tensor([[6.0, 9.0], [30.0, 21.0]]))
    with pytest.raises(ValueError, match="do not add up"):
        reduce_per_sample(values, "sum", (4, 3))


def test_each_stream_trains_on_its_own_rewards(tiny_model_dir, tmp_path):
    """Advantages (N, S): a stream's are the configured aggregation of the rewards routed to it alone (a `both`
    reward reaches both), with GDPO's per-reward normalisation as with plain sums; the policy's steps then return
    (B, 2) log-probabilities."""
    trainer = _trainer(
        tiny_model_dir,
        tmp_path,
        rewards=(loudness, "brightness", "jpeg_compressibility"),
        reward_modalities=["audio", "video", "both"],
    )
    assert trainer.reward_routes.tolist() == [[False, True, True], [True, False, True]]  # video: brightness + jpeg
    assert trainer.policy.runtime.stream_log_probs and list(trainer.policy.streams) == ["video", "audio"]
    rewards = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    weights = trainer.reward_weights
    total = (rewards * weights).sum(dim=1)
    advantages = trainer._routed_advantages(rewards, total, ["p"] * 8)
    torch.testing.assert_close(advantages[:, 0], group_advantages(rewards[:, 1] + rewards[:, 2], 4))
    torch.testing.assert_close(advantages[:, 1], group_advantages(rewards[:, 0] + rewards[:, 2], 4))
    trainer.args.multi_objective_aggregation = "normalize_then_sum"
    advantages = trainer._routed_advantages(rewards, total, ["p"] * 8)
    torch.testing.assert_close(advantages[:, 1], normalized_reward_sum(rewards[:, [0, 2]], weights[[0, 2]], 4))
    policy = trainer.policy
    latents = policy.initial_noise([torch.Generator().manual_seed(0)])
    step = policy.step(torch.zeros_like(latents), latents, torch.tensor([0]))
    assert step.log_prob.shape == (1, 2)


def _video_and_audio_gradients(trainer) -> tuple[float, float]:
    """Train one round and return the largest |gradient| that reached the transformer's video and audio outputs."""
    largest = {"video": 0.0, "audio": 0.0}

    def keep(module, inputs, outputs):
        for name, output in zip(("video", "audio"), outputs):
            if output.requires_grad:
                output.register_hook(
                    lambda grad, name=name: largest.update({name: max(largest[name], grad.abs().max().item())})
                )

    handle = trainer.policy.denoiser.register_forward_hook(keep)
    trainer.train()
    handle.remove()
    return largest["video"], largest["audio"]


@pytest.mark.parametrize("method", ["grpo", "nft"])
def test_an_audio_reward_leaves_the_video_tokens_gradient_zero(tiny_model_dir, tmp_path, method):
    """Routed, an audio-only reward moves the audio tokens' outputs and leaves the video tokens' gradient exactly 0
    (GRPO: the video stream's advantage is 0; NFT: no reward judges it, its term is dropped); every forward of the
    pipeline's guidance (CFG, STG, modality isolation) is trained. Unrouted (`both`), the same reward reaches the
    video tokens: the test can fail."""
    video, audio = _video_and_audio_gradients(_trainer(tiny_model_dir, tmp_path, method))
    assert video == 0.0 and audio > 0.0
    if method == "grpo":
        unrouted = _trainer(tiny_model_dir, tmp_path / "both", method, reward_modalities=["both"])
        assert unrouted.reward_routes is None and not unrouted.policy.runtime.stream_log_probs
        video, audio = _video_and_audio_gradients(unrouted)
        assert video > 0.0 and audio > 0.0


def test_routing_refusals(tiny_model_dir, tmp_path):
    """Bad input: a count that does not match the rewards, an unknown modality, audio judged on a family without it,
    methods and options with one advantage or ratio per sample."""
    with pytest.raises(ValueError, match="2 reward_modalities for 1 reward functions"):
        _trainer(tiny_model_dir, tmp_path, reward_modalities=["audio", "video"])
    with pytest.raises(ValueError, match="reward_modalities must be one of"):
        _trainer(tiny_model_dir, tmp_path, reward_modalities=["sound"])
    with pytest.raises(ValueError, match="GRPO-Guard"):
        _trainer(tiny_model_dir, tmp_path, ratio_normalization=True)
    with pytest.raises(ValueError, match="per_prompt"):
        _trainer(tiny_model_dir, tmp_path, scale_rewards="per_prompt")
    with pytest.raises(ValueError, match="loss_type 'awm' has one advantage"):
        _trainer(tiny_model_dir, tmp_path, "nft", loss_type="awm")
    args = tiny_grpo_config(tmp_path, reward_modalities=["audio"])
    with pytest.raises(
        ValueError, match=r"rewards \['brightness'\] judge audio, which FluxPipeline does not generate"
    ):
        DanceGRPOTrainer(
            tiny_model_dir("flux"), "brightness", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
        )


# LTX-2 image-to-video, routed, 12 rounds at lr 3e-2 (LoRA also on the audio output projection, the audio stream's
# own last layer), 3 of 5 steps trained: the soundtrack's loudness rises +3.1e-4 / +5.0e-4 / +4.2e-4 (seeds 42 / 1 / 2;
# first-round sample std 8.4-9.3e-5) and the videos' brightness +0.059 / +0.068 / +0.065 (std 0.013-0.014). With all
# 5 steps: +3.6e-4 / +4.3e-4 / +4.2e-4 and +0.069 / +0.072 / +0.048, in 1.4x the time; with 2: seed 1 gained 1.0e-4. On text-to-video, unrouted
# (both rewards on both streams, the weighted sum), seed 42: loudness +1.6e-4 against +5.0e-4 routed (brightness
# +0.023 / +0.027): on its scale (1e-4 against brightness's 3e-3) the audio reward is hidden in the sum. Margins: the
# smallest gains / 2.3. (16 videos a round halve the time but loudness then gains +2.5e-4 / +3.6e-4, seeds 42 / 1:
# too near twice its sample std.)
@pytest.mark.slow
def test_routed_audio_and_video_rewards_rise_on_image_to_video(tiny_model_dir, tmp_path):
    """Learning on LTX-2 image-to-video with brightness judging the video and loudness the audio: each stream trains
    on its own reward's advantages; both rise beyond their sample noise, the audio reward 100 times smaller."""
    args = tiny_grpo_config(
        tmp_path,
        generation_batch_size=32,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=6,
        timestep_fraction=0.6,
        max_steps=12,
        guidance_scale=1.0,
        pipeline_kwargs={**UNGUIDED, "image_crf": 0},
        reward_modalities=["audio", "video"],
        seed=LEARNING_SEED,
        **family_overrides("ltx2"),
    )
    lora = LoraConfig(
        r=8, lora_alpha=8, target_modules=[*LORA_TARGETS, "audio_proj_out"], init_lora_weights="gaussian"
    )
    rows = {"prompt": PROMPTS, "image": tiny_condition_images(len(PROMPTS))}
    trainer = DanceGRPOTrainer(
        tiny_model_dir("ltx2-i2v"), [loudness, "brightness"], args=args, train_dataset=Dataset.from_dict(rows),
        peft_config=lora,
    )  # fmt: skip
    trainer.train()
    rounds = [h for h in trainer.state.log_history if "rewards/loudness/mean" in h]
    for reward, margin in (("loudness", 1.3e-4), ("brightness", 0.02)):
        first, last = (sum(h[f"rewards/{reward}/mean"] for h in part) / 3 for part in (rounds[:3], rounds[-3:]))
        assert_learned(reward, first, last, rounds[0][f"rewards/{reward}/std"], margin)


def _audio_gradient_of_the_video(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """The denoiser's output at step 1 for two prompts, and the gradient in the audio latents of a fixed random
    projection of its video part (which reads the audio only through the audio→video cross-attention)."""
    policy = trainer.policy
    latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)]).requires_grad_(True)
    output = policy.predict(trainer.model, latents, policy.encode_prompts(PROMPTS[:2]), at=1)
    video = policy.streams["video"]
    weights = torch.randn(output[:, :video].shape, generator=torch.Generator().manual_seed(0))
    (output[:, :video] * weights).sum().backward()
    return output.detach(), latents.grad[:, video:]


def test_gradient_surgery_scales_the_audio_gradient_of_the_video_and_keeps_the_forward(tiny_model_dir, tmp_path):
    """OmniNFT's layer-wise surgery (`audio_to_video_gradient_scales`): with scale 0 in both blocks the video's
    gradient in the audio latents is exactly 0; with 0.5 in block 0 (0 in block 1: one crossing) it is half that of 1
    there; compiled blocks (installed before compiling) honour it; the outputs are bit-identical throughout."""

    def run(scales, **extra):
        trainer = _trainer(
            tiny_model_dir, tmp_path / f"{scales}{extra}", guidance_scale=1.0, pipeline_kwargs=UNGUIDED,
            audio_to_video_gradient_scales=scales, **extra,
        )  # fmt: skip
        return _audio_gradient_of_the_video(trainer)

    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    plain_output, plain = run(None)
    runs = {"zero": run({"0-1": 0.0}), "one": run({"1": 0}), "half": run({"0": 0.5, "1": 0.0})}
    runs["compiled zero"] = run('{"0-1": 0}', **compiled)  # (a JSON object, as the command line passes it)
    assert all(torch.equal(output, plain_output) for output, _ in runs.values())
    assert plain.abs().max() > 0 and runs["one"][1].abs().max() > 0
    assert runs["zero"][1].abs().max() == 0 and runs["compiled zero"][1].abs().max() == 0
    torch.testing.assert_close(runs["half"][1], 0.5 * runs["one"][1], rtol=1e-6, atol=0)


def test_bad_gradient_surgery_input_fails_at_construction(tiny_model_dir, tmp_path):
    from trl_dance.trainer.gradient_surgery import block_scales

    assert block_scales({"0": 0, "2-3": 0.1}) == {0: 0.0, 2: 0.1, 3: 0.1}
    for spec, match in (
        ({"a": 0.1}, "not a block index"),
        ({"0-1": 0.1, "1": 0.0}, "names block 1 twice"),
        ({"3-1": 0.1}, "is empty"),
        ({"0": -1.0}, "finite number >= 0"),
        ("0:0.5", "must map blocks to scales"),
    ):
        with pytest.raises(ValueError, match=match):
            tiny_grpo_config(tmp_path, audio_to_video_gradient_scales=spec)
    with pytest.raises(ValueError, match="names block 2, but the denoiser has 2 blocks"):
        _trainer(tiny_model_dir, tmp_path, audio_to_video_gradient_scales={"2": 0.0})
    with pytest.raises(ValueError, match="needs LTX-2's audio→video cross-attention"):
        DanceGRPOTrainer(tiny_model_dir("flux"), "brightness", train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}),
                         args=tiny_grpo_config(tmp_path / "flux", audio_to_video_gradient_scales={"0": 0.0}))  # fmt: skip
