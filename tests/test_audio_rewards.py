"""Audio rewards: band-limited resampling in closed form, the CLAP score on a tiny offline ``ClapModel`` against the
model's own forward, and CLAP by name on LTX-2, routed to the audio stream."""

import math

import pytest
import torch
from conftest import PROMPTS, family_overrides, tiny_grpo_config
from datasets import Dataset
from reward_checkpoints import save_tiny_clap

from trl_dance import DanceGRPOTrainer
from trl_dance.rewards import CLAPScore, get_reward_function
from trl_dance.rewards.audio import av_sync, resample


@pytest.mark.parametrize(("orig", "new"), [(24000, 48000), (48000, 16000), (16000, 44100)])
def test_resampling_keeps_a_tone(orig, new):
    """A 440 Hz + 3 kHz tone sampled at ``orig`` and resampled to ``new`` equals the tone sampled at ``new`` to 1e-3
    away from the edges (the windowed sinc's passband), keeps the length ratio, and leaves DC at gain 1."""
    seconds = 0.25

    def tone(rate):
        t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
        return (torch.sin(2 * math.pi * 440 * t) + 0.5 * torch.sin(2 * math.pi * 3000 * t + 1.0)).float()

    out = resample(tone(orig)[None, None], orig, new)[0, 0]
    assert out.shape[-1] == math.ceil(int(seconds * orig) * new / orig)
    edge = new // 50  # 20 ms
    reference = tone(new)
    length = min(len(out), len(reference))
    assert (out[edge : length - edge] - reference[edge : length - edge]).abs().max() < 1e-3
    dc = resample(torch.ones(2, 4000), orig, new)
    torch.testing.assert_close(dc[:, edge:-edge], torch.ones_like(dc[:, edge:-edge]), atol=1e-3, rtol=0)
    assert torch.equal(resample(reference, new, new), reference)


def test_clap_score_is_the_models_cosine(tmp_path):
    """The reward is the cosine of ClapModel's own audio and text embeddings of the mono mix, at the extractor's 48
    kHz: a 24 kHz stereo soundtrack is averaged and resampled first; ``modality`` routes it to the audio stream."""
    from transformers import ClapModel, ClapProcessor

    folder = save_tiny_clap(str(tmp_path / "clap"))
    reward = get_reward_function("clap", model=folder)
    assert isinstance(reward, CLAPScore) and reward.modality == "audio" and reward.accepts_audio
    generator = torch.Generator().manual_seed(0)
    stereo = 0.3 * torch.randn(3, 2, 48000, generator=generator)
    prompts = PROMPTS[:3]
    scores = reward(prompts, torch.zeros(3, 2, 3, 8, 8), audio=stereo, audio_sample_rate=48000)
    model, processor = ClapModel.from_pretrained(folder).eval(), ClapProcessor.from_pretrained(folder)
    inputs = processor(
        text=prompts, audio=list(stereo.mean(dim=1).numpy()), sampling_rate=48000, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        output = model(**inputs)
    expected = (output.audio_embeds * output.text_embeds).sum(dim=-1)
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=0)
    assert len(set(scores)) == 3 and all(-1 <= s <= 1 for s in scores)
    low = stereo[..., ::2]  # the same signal's every other sample: 24 kHz, resampled back to 48 kHz
    rescored = reward(prompts, torch.zeros(3, 2, 3, 8, 8), audio=low, audio_sample_rate=24000)
    assert rescored != scores
    with pytest.raises(ValueError, match="one waveform"):
        reward(prompts, torch.zeros(3, 2, 3, 8, 8), audio=stereo[0], audio_sample_rate=48000)


def test_clap_by_name_routes_to_the_audio_stream(tiny_model_dir, tmp_path):
    """``trl-dance grpo --reward_funcs clap videoalign``-style use: CLAP by name with its checkpoint in
    ``reward_kwargs`` scores LTX-2's soundtracks and trains the audio stream alone, brightness the video."""
    folder = save_tiny_clap(str(tmp_path / "clap"))
    args = tiny_grpo_config(
        tmp_path,
        max_steps=1,
        guidance_scale=1.0,
        reward_kwargs={"clap": {"model": folder}},
        **family_overrides("ltx2"),
    )
    trainer = DanceGRPOTrainer(
        tiny_model_dir("ltx2"), ["clap", "brightness"], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
    )
    assert trainer.reward_routes.tolist() == [[False, True], [True, True]]  # brightness: "both" (its default)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["rewards/clap/mean"])


def test_av_sync_in_closed_form():
    """Motion that follows the soundtrack's loudness scores 1, the opposite −1, a still video 0; the reward judges both
    streams."""
    envelope = torch.tensor([0.1, 0.9, 0.2, 0.7, 0.4])  # per frame step (frames 1-5 of 6)
    frames = torch.zeros(3, 6, 3, 4, 4)
    for t in range(1, 6):  # each frame step moves the pixels by the envelope's value
        frames[:, t] = frames[:, t - 1] + envelope[t - 1] / 10 * (1 if t % 2 else -1)
    frames += 0.5
    frames[2] = 0.5  # a still video
    carrier = torch.tensor([1.0, -1.0]).repeat(300)  # a square wave: its RMS over a window is the amplitude

    def soundtrack(steps):  # (2, 600): 6 windows of 100 samples, the first (frame 0) at 0.3, then ``steps``
        return torch.stack([torch.cat([torch.tensor([0.3]), steps]).repeat_interleave(100) * carrier] * 2)

    audio = torch.stack([soundtrack(envelope), soundtrack(1 - envelope), soundtrack(envelope)])
    scores = av_sync(PROMPTS[:3], frames, audio)
    assert (
        scores[0] == pytest.approx(1.0, abs=1e-6) and scores[1] == pytest.approx(-1.0, abs=1e-6) and scores[2] == 0.0
    )
    assert get_reward_function("av_sync").modality == "both"
    with pytest.raises(ValueError, match="F >= 3"):
        av_sync(PROMPTS[:1], frames[:1, :2], audio[:1])
