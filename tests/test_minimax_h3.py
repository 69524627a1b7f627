"""MiniMax-H3 (text-to-audio-video on a modular pipeline): parity with the pipeline's own sampler, the two σ grids of
one transition in closed form, refusals, GRPO's ratio 1 with the saved LoRA reloading, routed rewards, learning."""

import pytest
import torch
from conftest import (
    LEARNING_SEED,
    LORA_TARGETS,
    PROMPTS,
    assert_given_prefix_is_held,
    assert_learned,
    max_ratio_deviation,
    tiny_grpo_config,
)
from datasets import Dataset
from peft import LoraConfig
from test_reward_routing import _video_and_audio_gradients, loudness

from trl_dance import DanceGRPOTrainer
from trl_dance.policies import SamplerSettings, StreamFlowProcess, make_policy
from trl_dance.sde import flow_sde_step, join_streams
from trl_dance.testing import TINY_PIPELINES, tiny_condition_images
from trl_dance.testing.minimax_h3 import MINIMAX_H3_TINY_FRAMES

H3 = {
    "num_frames": MINIMAX_H3_TINY_FRAMES,
    "max_sequence_length": 32,
    "sigma_schedule": "pipeline",
    "guidance_scale": 1.0,
}
STEPS = 4


def _settings(**values) -> SamplerSettings:
    return SamplerSettings(height=32, width=32, num_inference_steps=STEPS, **(H3 | values))


@pytest.mark.parametrize("keyframes", [(), ("image",), ("image", "last_image"), ("last_image",)])
def test_minimax_h3_reproduces_the_pipeline(keyframes):
    """The policy's ODE sampling (eta 0) of two prompts of different lengths in one batch equals the pipeline's
    sampler run on each (its ``num_inference_steps`` counts the grid's N + 1 points): noise drawn as it draws it, the
    packed layout and per-row timesteps its blocks build, both σ grids, the data-ward velocity; the decoded video
    frames and stereo waveforms equal. With keyframes (rows with ``image`` / ``last_image``: the ``fl2va`` workflow),
    each prompt read with its keyframes' vision blocks, their latents anchored at t = 0.999 with the noise drawn
    first, as the pipeline does; the keyframes change the result."""
    pipeline = TINY_PIPELINES["minimax-h3"](0)
    policy = make_policy(pipeline, _settings(eta=0.0, max_sequence_length=64))
    policy.use_condition_columns(["prompt", *keyframes])
    prompts, images = ["a cat playing the piano in the rain", "rain"], tiny_condition_images(4)
    columns = {name: images[:2] if name == "image" else images[2:] for name in keyframes}
    with torch.no_grad():
        latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
        cond = policy.encode_prompts(prompts, **columns)
        assert cond["prompt_length"].tolist()[0] > cond["prompt_length"].tolist()[1]
        for i in range(STEPS):
            output = policy.predict(policy.denoiser, latents, cond, at=i)
            latents = policy.step(output, latents, torch.full((2,), i), compute_log_prob=False).prev_sample
        videos, audio = policy.decode(latents), policy.decode_audio(latents)
    for index, prompt in enumerate(prompts):
        given = {name: values[index] for name, values in columns.items()}
        expected = pipeline(
            prompt=prompt, num_inference_steps=STEPS + 1, height=32, width=32, num_frames=MINIMAX_H3_TINY_FRAMES,
            generator=torch.Generator().manual_seed(index), output_type="pt", **given,
        ).values  # fmt: skip
        if keyframes and index == 0:
            text_only = pipeline(
                prompt=prompt, num_inference_steps=STEPS + 1, height=32, width=32, num_frames=MINIMAX_H3_TINY_FRAMES,
                generator=torch.Generator().manual_seed(index), output_type="pt",
            ).values["videos"]  # fmt: skip
            assert (text_only - expected["videos"]).abs().max() > 1e-3
        assert videos[index].shape == expected["videos"][0].shape == (MINIMAX_H3_TINY_FRAMES, 3, 32, 32)
        torch.testing.assert_close(videos[index], expected["videos"][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(audio[index], expected["audio"][0], rtol=0, atol=1e-5)
    assert policy.audio_sample_rate == pipeline.audio_sampling_rate
    assert videos.std() > 0.01 and audio.std() > 0.01 and not torch.equal(audio[0], audio[1])


def test_the_streams_step_on_their_own_grids():
    """One transition of the packed row is, stream by stream, the flow SDE step at that stream's σ (the video's grid
    of shift 12, the audio's of shift 3, as the pipeline's two schedulers build them): the same mean, per-element std
    and log-density (per stream with ``segments``; joined, the whole row's), and the denoiser sees each stream's
    ``1 − σ``."""
    pipeline = TINY_PIPELINES["minimax-h3"](0)
    policy = make_policy(pipeline, _settings(eta=0.7, sde_type="flow_grpo"))
    process, streams = policy.process, policy.streams
    assert isinstance(process, StreamFlowProcess) and list(streams) == ["video", "audio"]
    for grid, scheduler in zip(process.stream_sigmas, (pipeline.scheduler, pipeline.audio_scheduler)):
        copy = type(scheduler).from_config(scheduler.config)
        copy.set_timesteps(STEPS + 1)
        assert torch.equal(grid, copy.sigmas)
    assert not torch.equal(process.stream_sigmas[0], process.stream_sigmas[1])
    generator = torch.Generator().manual_seed(0)
    size = sum(streams.values())
    v, x = torch.randn(3, size, generator=generator), torch.randn(3, size, generator=generator)
    steps = torch.tensor([0, 1, 2])
    drawn = policy.step(v, x, steps, generator=generator)
    scored = process.step(v, x, steps, prev_sample=drawn.prev_sample, segments=tuple(streams.values()))
    start = 0
    for stream, count in enumerate(streams.values()):
        grid, part = process.stream_sigmas[stream], slice(start, start + count)
        alone = flow_sde_step(
            v[:, part], x[:, part], grid[steps], grid[steps + 1], sde_type="flow_grpo", eta=0.7,
            prev_sample=drawn.prev_sample[:, part], sigma_max=grid[1],
        )  # fmt: skip
        torch.testing.assert_close(scored.mean[:, part], alone.mean)
        torch.testing.assert_close(scored.std[:, part], alone.std[:, None].expand(-1, count))
        torch.testing.assert_close(scored.log_prob[:, stream], alone.log_prob)
        torch.testing.assert_close(process.model_timestep(steps)[:, stream], 1 - grid[steps])
        start += count
    whole = process.step(v, x, steps, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(join_streams(scored.log_prob, tuple(streams.values())), whole.log_prob)


def test_minimax_h3_refusals(tiny_model_dir, tmp_path):
    """What needs one σ per sample (the forward process, Δσ options), guidance, frame counts the VAE cannot take,
    context parallelism."""
    pipeline = TINY_PIPELINES["minimax-h3"](0)
    policy = make_policy(pipeline, _settings())
    with pytest.raises(NotImplementedError, match="own σ grids"):
        policy.process.add_noise(torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([0.5]))
    with pytest.raises(NotImplementedError, match="own σ grids"):
        policy.process.sigma(torch.tensor([0]))
    with pytest.raises(ValueError, match="guidance-distilled"):
        make_policy(pipeline, _settings(guidance_scale=4.0))
    with pytest.raises(ValueError, match=r"num_frames must be 17·n \+ 5"):
        make_policy(pipeline, _settings(num_frames=121))
    with pytest.raises(ValueError, match=r"num_frames must be in \[120, 360\]"):
        make_policy(pipeline, _settings(num_frames=107))
    from trl_dance.trainer.context_parallel import check_context_parallel

    with pytest.raises(ValueError, match="changes length with each prompt.*set context_parallel_size 1"):
        check_context_parallel(policy, 2, "ulysses")
    args = tiny_grpo_config(tmp_path, ratio_normalization=True, **H3)
    with pytest.raises(ValueError, match="GRPO-Guard.*own σ grids"):
        DanceGRPOTrainer(tiny_model_dir("minimax-h3"), "brightness", args=args, train_dataset=_dataset())


def _dataset():
    return Dataset.from_dict({"prompt": PROMPTS[:8]})


def _lora():
    return LoraConfig(
        r=8, lora_alpha=8, target_modules=[*LORA_TARGETS, "audio_proj_out"], init_lora_weights="gaussian"
    )


def test_minimax_h3_grpo_is_on_policy_and_its_lora_reloads(tiny_model_dir, tmp_path):
    """A GRPO round on the modular pipeline loaded from its folder: prompts of several lengths sampled together, the
    on-policy ratio 1 (with gradients), an audio-only reward routed to the audio rows leaving the video outputs'
    gradient exactly 0, and the saved diffusers-format LoRA reproducing the trained predictions in a fresh
    pipeline."""
    from conftest import assert_saved_lora_reproduces_training

    args = tiny_grpo_config(tmp_path, max_steps=1, save_strategy="no", **H3)
    model = tiny_model_dir("minimax-h3")
    trainer = DanceGRPOTrainer(model, loudness, args=args, train_dataset=_dataset(), peft_config=_lora())
    assert trainer.reward_routes.tolist() == [[False], [True]]  # loudness judges the audio stream only
    trainer._generate_and_score([{"prompt": prompt} for prompt in ("a cat", "a red house") for _ in range(4)])
    assert len(set(trainer._rollout["cond"]["prompt_length"].tolist())) == 2
    assert max_ratio_deviation(trainer, grad=True) < 1e-5
    video, audio = _video_and_audio_gradients(trainer)
    assert video == 0.0 and audio > 0.0
    trainer.save_model(str(tmp_path / "lora"))
    assert_saved_lora_reproduces_training(trainer, model, str(tmp_path / "lora"), PROMPTS[:3])
    args = tiny_grpo_config(tmp_path / "both", max_steps=1, reward_modalities=["both"], **H3)
    unrouted = DanceGRPOTrainer(model, loudness, args=args, train_dataset=_dataset(), peft_config=_lora())
    video, audio = _video_and_audio_gradients(unrouted)
    assert video > 0.0 and audio > 0.0  # unrouted, the audio reward reaches the video rows: the check can fail


def test_minimax_h3_keyframes_train_on_policy(tiny_model_dir, tmp_path):
    """Rows with first and last keyframes (``fl2va``): ratio 1; the anchors' noise leads each row, is given (it never
    moves along the trajectory and moving it leaves the log-probability unchanged); another last keyframe changes
    the prediction; the model card's task is image-to-video."""
    images = tiny_condition_images(16)
    dataset = Dataset.from_dict({"prompt": PROMPTS[:8], "image": images[:8], "last_image": images[8:]})
    args = tiny_grpo_config(tmp_path, **(H3 | {"max_sequence_length": 64}))
    trainer = DanceGRPOTrainer(tiny_model_dir("minimax-h3"), "brightness", args=args, train_dataset=dataset)
    policy = trainer.policy
    assert policy.geometry.anchors == ("first", "last") and policy.pipeline_tag == "image-to-video"
    from trl_dance.trainer.evaluation import policy_with

    assert policy_with(policy, num_inference_steps=3).geometry.anchors == ("first", "last")  # (evaluation's sampler)
    trainer._generate_and_score([dict(dataset[i]) for i in (0, 1) for _ in range(4)])
    assert max_ratio_deviation(trainer) < 1e-5
    assert_given_prefix_is_held(trainer, policy.geometry.anchor_size)
    with torch.no_grad():
        latents = policy.initial_noise([torch.Generator().manual_seed(0)] * 2)
        cond = policy.encode_prompts(["a cat"] * 2, image=[images[0]] * 2, last_image=images[8:10])
        output = policy.predict(trainer.model, latents, cond, at=torch.tensor([1, 1]))
    assert (output[0] - output[1]).abs().max() > 1e-3


# Measured (TRL_DANCE_TEST_SEED 42 / 1 / 2): loudness +7.3e-3 / +3.3e-3 / +7.3e-3 in 8 rounds (first-round std
# 1.2–1.8e-4); margin = smallest gain / 2.3.
@pytest.mark.slow
def test_minimax_h3_learns_a_routed_audio_reward(tiny_model_dir, tmp_path):
    """Learning: loudness judging the audio rows rises beyond its sample noise, brightness judging the video beside
    it (each stream trained on its own reward's advantages)."""
    args = tiny_grpo_config(
        tmp_path, max_steps=8, timestep_fraction=0.4, gradient_accumulation_steps=2, seed=LEARNING_SEED,
        reward_modalities=["audio", "video"], **H3,
    )  # fmt: skip
    trainer = DanceGRPOTrainer(
        tiny_model_dir("minimax-h3"), [loudness, "brightness"], args=args, train_dataset=_dataset(),
        peft_config=_lora(),
    )  # fmt: skip
    trainer.train()
    rounds = [h for h in trainer.state.log_history if "rewards/loudness/mean" in h]
    first, last = (sum(h["rewards/loudness/mean"] for h in part) / 3 for part in (rounds[:3], rounds[-3:]))
    assert_learned("loudness", first, last, rounds[0]["rewards/loudness/std"], 1.4e-3)
