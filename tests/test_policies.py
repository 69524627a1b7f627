"""Each policy against its diffusers pipeline: with the noise level at 0 the policy's sampler is the pipeline's
deterministic sampler, so everything between them (text conditioning, CFG and its negative branch, timestep units,
σ / ᾱ schedules, latent layout and normalisation, decoding) must agree from the same initial latents."""

import dataclasses

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.hunyuan_video import pipeline_hunyuan_skyreels_image2video as skyreels

from trl_dance.policies import SamplerSettings, make_policy
from trl_dance.testing import TINY_PIPELINES, TINY_VIDEO_FRAMES, tiny_condition_images, tiny_flux2_klein_pipeline

PROMPTS = ["a red cat", "a blue dog"]
EDITING = ("flux-kontext",)
STEPS = 6


@pytest.mark.parametrize(
    ("kind", "guidance", "negative_prompt"),
    [
        ("flux", 3.5, None),
        ("flux-kontext", 2.5, None),
        ("flux2", 4.0, None),  # (its pipeline takes latents unpacked: (B, 4C, H/4, W/4))
        ("flux2-klein", 4.0, None),  # the base checkpoint: true CFG against the empty prompt
        ("flux2-klein", 1.0, None),
        ("flux2-klein-distilled", 4.0, None),  # no CFG whatever guidance_scale says, as its pipeline
        ("sd3", 1.0, None),
        ("sd3", 4.0, None),
        ("sd3", 4.0, "blurry, dark"),
        ("sd", 5.0, None),
        ("sd", 5.0, "blurry, dark"),
        ("sd2", 1.0, None),  # v-prediction
        ("sd2", 5.0, None),
        ("sdxl", 5.0, None),  # the pipeline's zeros for the empty negative prompt
        ("sdxl", 5.0, "blurry, dark"),
        ("qwen-image", 1.0, None),
        ("qwen-image", 4.0, None),  # the empty negative prompt, spelled out for the pipeline
        ("qwen-image", 4.0, "blurry, dark"),
        ("hunyuan-video", 6.0, None),
        ("hunyuan-image", 6.0, None),  # one frame: HunyuanVideo as a text-to-image model
        ("skyreels-i2v", 6.0, None),  # true CFG against the empty negative prompt, spelled out for the pipeline
        ("skyreels-i2v", 6.0, "blurry, dark"),
        ("wan", 5.0, None),
        ("wan", 5.0, "blurry, dark"),
        ("wan-i2v", 5.0, None),
        ("wan-flf2v", 5.0, None),  # first and last frames
        ("wan22-5b", 5.0, None),
        ("wan22-5b-i2v", 5.0, None),
        ("z-image", 0.0, None),  # Z-Image-Turbo: no CFG at guidance_scale 0
        ("z-image", 4.0, None),  # c + 4 (c − u) against the empty prompt
        ("z-image", 4.0, "blurry, dark"),
    ],
)
def test_deterministic_policy_sampling_reproduces_the_pipeline(kind, guidance, negative_prompt, monkeypatch):
    _assert_policy_reproduces_pipeline(kind, guidance, negative_prompt=negative_prompt, monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    ("kind", "train_expert", "last_image"),
    [
        ("wan22", "high_noise", False),
        ("wan22", "low_noise", False),
        ("wan22-i2v", "low_noise", False),
        ("wan22-i2v", "high_noise", True),  # first and last frames (the rows' optional last_image column)
    ],
)
def test_two_expert_wan_reproduces_the_pipeline(kind, train_expert, last_image):
    """Wan 2.2 A14B (T2V, I2V, first-last-frame): steps 0-1 of 6 are the high-noise expert's (CFG 5), the others the
    low-noise one's (CFG 3); whichever is trained, the frozen one serves its steps with its own scale."""
    policy = _assert_policy_reproduces_pipeline(
        kind, 5.0, guidance_scale_2=3.0, train_expert=train_expert, last_image=last_image
    )
    assert ("last_image" in policy.condition_columns) == last_image
    expected = [0, 1] if train_expert == "high_noise" else [2, 3, 4]
    assert policy.trainable_steps() == expected
    assert policy.denoiser is (
        policy.pipeline.transformer if train_expert == "high_noise" else policy.pipeline.transformer_2
    )


def _deterministic(guidance, negative_prompt=None, **more) -> SamplerSettings:
    """The policy's deterministic sampler (η 0) on the pipeline's σ grid, STEPS steps at 32²."""
    return SamplerSettings(
        **{
            "num_inference_steps": STEPS,
            "height": 32,
            "width": 32,
            "guidance_scale": guidance,
            "eta": 0.0,
            "sigma_schedule": "pipeline",
            "negative_prompt": negative_prompt,
            **more,
        }
    )


def _sample_deterministically(policy, latents, prompts, columns=None):
    """The policy's sampler from ``latents`` with its settings' noise level (0 here), decoded: (B, ...) in [0, 1]."""
    return _sample_conditioned(policy, latents, policy.encode_prompts(list(prompts), **(columns or {})))


def _sample_conditioned(policy, latents, cond):
    """:func:`_sample_deterministically` from conditioning already encoded."""
    for i in range(policy.num_steps):
        index = torch.full((latents.shape[0],), i)
        output = policy.predict(policy.denoiser, latents, cond, at=i)
        latents = policy.step(output, latents, index, compute_log_prob=False).prev_sample
    return policy.decode(policy.final_latents(latents, cond))


def _assert_policy_reproduces_pipeline(
    kind, guidance, negative_prompt=None, guidance_scale_2=None, monkeypatch=None, last_image=False, **settings
):
    if kind == "flux2-klein-distilled":  # the step-distilled checkpoint: its pipeline ignores guidance_scale
        pipeline, kind = tiny_flux2_klein_pipeline(0, is_distilled=True), "flux2-klein"
    else:
        pipeline = TINY_PIPELINES["hunyuan-video" if kind == "hunyuan-image" else kind](0)
    video, columns, image_input = {}, {}, {}
    if kind.endswith(("i2v", "flf2v")) or kind in EDITING:  # (SkyReels I2V included)
        # The pipeline takes one image for all its prompts; the policy one per prompt.
        (image,) = tiny_condition_images(1)
        columns, image_input = {"image": [image] * len(PROMPTS)}, {"image": image}
    if kind == "wan-flf2v" or last_image:  # the last frame: another image
        last = tiny_condition_images(2)[1]
        columns["last_image"], image_input["last_image"] = [last] * len(PROMPTS), last
    if kind == "flux-kontext":
        # The source image at its own (the output) size, and the output at 32×32: not Kontext's 1-megapixel defaults.
        image_input |= {"_auto_resize": False, "max_area": 32 * 32}
    if kind.startswith("wan"):
        # Wan ships a multistep UniPC solver; the policy's deterministic step is Euler's.
        pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        video = {"num_frames": TINY_VIDEO_FRAMES}
    if kind.startswith("hunyuan"):
        video = {"num_frames": TINY_VIDEO_FRAMES if kind == "hunyuan-video" else 1}
    if kind == "skyreels-i2v":
        video = {"num_frames": TINY_VIDEO_FRAMES}
        image_input = {"image": [image_input["image"]] * len(PROMPTS)}  # this pipeline wants one image per prompt
        # The pipeline samples the image's VAE posterior; the policy conditions on its mean. Compare at the mean.
        monkeypatch.setattr(skyreels, "retrieve_latents", lambda output, generator: output.latent_dist.mode())
    if kind.startswith("sd") and kind != "sd3":
        # SD1.5 ships PNDM, SDXL Euler, neither clipping x̂0: the policy samples with DDIM from the same config (η = 0
        # here), which must not take DDIM's default clip_sample=True either.
        pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config, clip_sample=False)
    if guidance_scale_2 is not None:
        video["guidance_scale_2"] = guidance_scale_2
    policy = make_policy(
        pipeline, _deterministic(guidance, negative_prompt, max_sequence_length=16, **video, **settings)
    )
    policy.use_condition_columns(list(columns))  # (an optional column: Wan 2.2 A14B's last frame)
    initial = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(len(PROMPTS))])
    with torch.no_grad():
        ours = _sample_deterministically(policy, initial, PROMPTS, columns)

        kwargs = (
            {"max_sequence_length": 16}
            if kind in ("flux", "flux-kontext", "flux2", "flux2-klein", "sd3", "skyreels-i2v", "z-image")
            or kind.startswith(("wan", "hunyuan"))
            else {}
        )
        if kind in ("qwen-image", "skyreels-i2v"):  # true_cfg_scale, and CFG only with a negative prompt given
            kwargs = {"max_sequence_length": 16, "true_cfg_scale": guidance}
            negative_prompt = "" if negative_prompt is None and guidance > 1 else negative_prompt
            guidance = None if kind == "qwen-image" else 1.0  # SkyReels: the guidance embedding's 1.0
        result = pipeline(
            prompt=list(PROMPTS),  # a copy: Z-Image's pipeline writes its chat template into the list
            height=32,
            width=32,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            latents=initial.transpose(1, 2).reshape(2, -1, 8, 8) if kind.startswith("flux2") else initial.clone(),
            **(
                {}
                if kind.startswith("flux2")
                else {"negative_prompt": None if negative_prompt is None else [negative_prompt] * 2}
            ),
            output_type="pt",
            **video,
            **image_input,
            **kwargs,
        )
    expected = result.frames if kind.startswith(("wan", "hunyuan", "skyreels")) else result.images
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    return policy


@pytest.mark.parametrize(
    ("guidance", "negative_prompt", "prompts", "image_to_video"),
    [
        (6.0, None, PROMPTS, False),  # the guider's CFG against the empty prompt
        (6.0, "blurry, dark", PROMPTS, False),
        (6.0, None, ['a sign saying "hello"', "a cat"], False),  # quoted text: ByT5 glyph embeddings for one prompt
        (6.0, None, PROMPTS, True),
        (6.0, "blurry, dark", PROMPTS, True),
        (1.0, None, PROMPTS, True),
        (6.0, None, PROMPTS, "meanflow"),  # a MeanFlow (step-distilled) I2V transformer: r = the next step's time
        (1.0, None, PROMPTS, "meanflow"),
    ],
)
def test_hunyuan_video15_reproduces_the_pipeline(guidance, negative_prompt, prompts, image_to_video):
    """HunyuanVideo 1.5 samples with CFG from its guider (its scale there) and decodes one video at a time (its VAE's
    attention breaks on batches in diffusers 0.42.1), so the pipeline runs per prompt; its 1000-token text padding
    and 729 masked image slots against the policy's 64 and none give the same videos. Image-to-video: another image
    per prompt, as first-frame condition latents and SigLIP embeddings; a MeanFlow transformer embeds each step's end
    time r, the next step's time and 0 at the last, as the image-to-video pipeline passes it."""
    from diffusers.guiders import ClassifierFreeGuidance

    from trl_dance.testing.hunyuan_video import tiny_hunyuan_video15_i2v_pipeline

    if image_to_video == "meanflow":
        pipeline = tiny_hunyuan_video15_i2v_pipeline(0, meanflow=True)
    else:
        pipeline = TINY_PIPELINES["hunyuan-video15-i2v" if image_to_video else "hunyuan-video15"](0)
    images = tiny_condition_images(len(prompts)) if image_to_video else [None] * len(prompts)
    columns = {"image": images} if image_to_video else {}
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    settings = _deterministic(guidance, negative_prompt, max_sequence_length=64, num_frames=TINY_VIDEO_FRAMES)
    policy = make_policy(pipeline, settings)
    assert policy.flow_map == (image_to_video == "meanflow")
    initial = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(len(prompts))])
    with torch.no_grad():
        ours = _sample_deterministically(policy, initial, prompts, columns)
        expected = torch.cat(
            [
                pipeline(
                    prompt=[prompt],
                    negative_prompt=negative_prompt,
                    num_frames=TINY_VIDEO_FRAMES,
                    num_inference_steps=STEPS,
                    latents=initial[b : b + 1].clone(),
                    output_type="pt",
                    **({"image": images[b]} if image_to_video else {"height": 32, "width": 32}),
                ).frames
                for b, prompt in enumerate(prompts)
            ]
        )
    assert ours.shape == expected.shape == (len(prompts), TINY_VIDEO_FRAMES, 3, 32, 32)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "guidance", "negative_prompt", "sources"),
    [
        ("qwen-image-edit", 1.0, None, (0, 1)),
        ("qwen-image-edit", 4.0, None, (0, 1)),  # the empty negative prompt, read with each sample's source
        ("qwen-image-edit", 4.0, "blurry, dark", (0, 1)),
        ("qwen-image-edit-plus", 4.0, None, ((0, 2), (1, 0))),  # two sources per sample
    ],
)
def test_qwen_image_edit_reproduces_the_pipeline(kind, guidance, negative_prompt, sources, small_edit_sources):
    """Qwen-Image-Edit(-Plus): other sources per sample (the pipelines take one prompt at a time: Edit-Plus allows no
    more), each encoded by the VAE and read by the text encoder's vision tower, at the tiny sizes of conftest's
    ``small_edit_sources``; 2511's ``zero_cond_t`` in the Plus pipeline."""
    pipeline = TINY_PIPELINES[kind](0)
    images = tiny_condition_images(3)
    pick = [[images[i] for i in row] if isinstance(row, tuple) else images[row] for row in sources]
    prompts = ["make it red", "add a cat"]
    policy = make_policy(pipeline, _deterministic(guidance, negative_prompt, max_sequence_length=64))
    initial = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(len(prompts))])
    negative = "" if negative_prompt is None and guidance > 1 else negative_prompt  # spelled out for the pipeline
    with torch.no_grad():
        ours = _sample_deterministically(policy, initial, prompts, {"image": pick})
        expected = torch.cat(
            [
                pipeline(
                    image=pick[b],
                    prompt=prompt,
                    negative_prompt=negative,
                    true_cfg_scale=guidance,
                    height=32,
                    width=32,
                    num_inference_steps=STEPS,
                    latents=initial[b : b + 1].clone(),
                    output_type="pt",
                ).images
                for b, prompt in enumerate(prompts)
            ]
        )
    assert ours.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("guidance", "negative_prompt", "steps"),
    [
        (1.0, None, 8),  # the shipped 8-step sample_sigmas grid, which the pipeline takes whatever its step count
        (4.0, None, 6),  # that grid interpolated to 6 steps (passed to the pipeline as its sigmas)
        (4.0, "blurry, dark", 6),
    ],
)
def test_qwen_image21_reproduces_the_pipeline(guidance, negative_prompt, steps):
    """Qwen-Image 2.1: prompts of three lengths, batched as the pipeline batches them (padded to the longest, which
    moves the shorter prompts' images) and one at a time, each equal to the pipeline's call on the same prompts (its
    prompt keys and values cached or recomputed); a sample forwarded in another batch keeps its encoded length."""
    from trl_dance.policies.qwen_image21 import resampled_sigmas

    pipeline = TINY_PIPELINES["qwen-image21"](0)
    prompts = ["a red cat", "a photograph of a blue dog", "a red car"]
    policy = make_policy(
        pipeline, _deterministic(guidance, negative_prompt, max_sequence_length=64, num_inference_steps=steps)
    )
    initial = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(len(prompts))])
    sigmas = None if steps == 8 else list(resampled_sigmas(pipeline.config.sample_sigmas, steps))
    negative = {"negative_prompt": negative_prompt or ""} if guidance > 1 else {}

    def call(batch, latents, use_kv_cache):
        return pipeline(
            prompt=batch,
            height=32,
            width=32,
            sigmas=sigmas,
            true_cfg_scale=guidance,
            latents=latents.clone(),
            output_type="pt",
            use_kv_cache=use_kv_cache,
            **({key: [value] * len(batch) for key, value in negative.items()}),
        ).images[:, :3]  # the VAE's RGBA: its RGB

    with torch.no_grad():
        batched = _sample_deterministically(policy, initial, prompts)
        single = torch.cat([_sample_deterministically(policy, initial[i : i + 1], [p]) for i, p in enumerate(prompts)])
        for use_kv_cache in (False, True):
            torch.testing.assert_close(batched, call(prompts, initial, use_kv_cache), rtol=0, atol=1e-5)
            expected = torch.cat([call([p], initial[i : i + 1], use_kv_cache) for i, p in enumerate(prompts)])
            torch.testing.assert_close(single, expected, rtol=0, atol=1e-5)
        assert (batched - single).abs().max() > 1e-4  # the padding moved the shorter prompts' images
        # The first prompt as encoded with the others, forwarded without them: its batched image.
        first = {key: value[:1] for key, value in policy.encode_prompts(prompts).items()}
        alone = _sample_conditioned(policy, initial[:1], first)
    torch.testing.assert_close(alone, batched[:1], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("guidance", "negative_prompt"), [(1.0, None), (4.0, "blurry, dark")])
def test_qwen_image21_with_a_condition_image_reproduces_the_pipeline(guidance, negative_prompt):
    """Qwen-Image 2.1's image-conditioned mode (rows with an ``image``): each prompt read with its condition image by
    the text encoder (its vision tokens the slots of the image's VAE latents in the transformer's sequence), the
    negative with the same image; two prompts of different lengths and images in one batch, each equal to the
    pipeline's call with its image (keys and values cached or not). Without the image the result differs."""
    pipeline = TINY_PIPELINES["qwen-image21"](0)
    prompts, images = ["a red cat", "a photograph of a blue dog"], tiny_condition_images(2)
    settings = _deterministic(  # (8 steps: the shipped sample_sigmas grid the pipeline samples on)
        guidance, negative_prompt, num_inference_steps=8, max_sequence_length=64,
        pipeline_kwargs={"output_resolution": 32},
    )  # fmt: skip
    policy = make_policy(pipeline, settings)
    policy.use_condition_columns(["prompt", "image"])
    initial = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(2)])
    negative = {"negative_prompt": [negative_prompt or ""]} if guidance > 1 else {}
    with torch.no_grad():
        ours = _sample_deterministically(policy, initial, prompts, {"image": images})
        for i, (prompt, image) in enumerate(zip(prompts, images)):
            for use_kv_cache in (False, True):
                expected = pipeline(
                    prompt=[prompt], image=image, height=32, width=32, true_cfg_scale=guidance, output_resolution=32,
                    latents=initial[i : i + 1].clone(), output_type="pt", use_kv_cache=use_kv_cache, **negative,
                ).images[:, :3]  # fmt: skip
                torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=1e-5)
        text_only = pipeline(
            prompt=prompts[:1], height=32, width=32, true_cfg_scale=guidance, latents=initial[:1].clone(),
            output_type="pt", **negative,
        ).images[:, :3]  # fmt: skip
    assert (ours[:1] - text_only).abs().max() > 1e-3


def test_hunyuan_video15_meanflow_reads_a_time_as_the_instantaneous_velocity():
    """On a MeanFlow transformer a time (not a step) is the instantaneous velocity, r = t; at a step the jump's end
    time is the next step's, and the two outputs differ (r matters). Parity with the pipeline: the test above."""
    from trl_dance.testing.hunyuan_video import tiny_hunyuan_video15_i2v_pipeline

    pipeline = tiny_hunyuan_video15_i2v_pipeline(0, meanflow=True)
    images = tiny_condition_images(1)
    settings = _deterministic(6.0, None, max_sequence_length=64, num_frames=TINY_VIDEO_FRAMES)
    policy = make_policy(pipeline, settings)
    latents, step = policy.initial_noise([torch.Generator().manual_seed(0)]), 2
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS[:1], image=images)
        at_time = policy.predict(pipeline.transformer, latents, cond, at=float(policy.process.sigma_values[step]))
        timestep = policy.process.model_timestep(torch.tensor([step]))
        instantaneous = policy._guided(pipeline.transformer, latents, timestep, {**cond, "timestep_r": timestep})
        torch.testing.assert_close(at_time, instantaneous, rtol=0, atol=0)
        jump = policy.predict(pipeline.transformer, latents, cond, at=step)
        assert (jump - at_time).abs().max() > 1e-4


def test_hunyuan_video15_refuses_guiders_it_does_not_reproduce():
    from diffusers.guiders import AdaptiveProjectedGuidance, ClassifierFreeGuidance

    pipeline = TINY_PIPELINES["hunyuan-video15"](0)
    settings = SamplerSettings(height=32, width=32, guidance_scale=6.0, num_frames=TINY_VIDEO_FRAMES)
    for guider in (ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7), AdaptiveProjectedGuidance()):
        pipeline.guider = guider
        with pytest.raises(ValueError, match="reproduces a ClassifierFreeGuidance guider"):
            make_policy(pipeline, settings)


@pytest.mark.parametrize(("kind", "guidance"), [("flux", 3.5), ("sd3", 1.0)])
def test_a_negative_prompt_without_cfg_is_refused(kind, guidance):
    settings = SamplerSettings(height=32, width=32, guidance_scale=guidance, negative_prompt="blurry")
    with pytest.raises(ValueError, match="negative_prompt feeds the unconditional branch of CFG"):
        make_policy(TINY_PIPELINES[kind](0), settings)


@pytest.mark.parametrize(
    ("kind", "shipped"), [("sd", "PNDMScheduler"), ("sd2", "DDIMScheduler"), ("sdxl", "EulerDiscreteScheduler")]
)
def test_unet_policies_start_from_ddim_noise_whatever_scheduler_ships(kind, shipped):
    """The tiny UNet pipelines ship the real checkpoints' schedulers; the policy's DDIM starts from unit-variance
    noise, not from the shipped scheduler's init_noise_sigma (SDXL's Euler: 14.6)."""
    pipeline = TINY_PIPELINES[kind](0)
    assert type(pipeline.scheduler).__name__ == shipped
    policy = make_policy(pipeline, SamplerSettings(num_inference_steps=STEPS, height=32, width=32, guidance_scale=1.0))
    noise = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(64)])
    assert noise.shape == (64, 4, 16, 16)
    assert abs(noise.std().item() - 1) < 0.02


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("prediction_type", "flow_prediction", "prediction_type 'flow_prediction' is not supported"),
        ("thresholding", True, "sets thresholding=True"),
    ],
)
def test_unsupported_unet_scheduler_settings_are_refused(option, value, match):
    pipeline = TINY_PIPELINES["sd"](0)
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config, **{option: value})
    with pytest.raises(ValueError, match=match):
        make_policy(pipeline, SamplerSettings(height=32, width=32))


def test_register_policy_and_unregistered_pipelines():
    from diffusers import DiffusionPipeline, FluxPipeline

    from trl_dance import register_policy
    from trl_dance.policies import FluxPolicy, policy_class

    class BarePipeline(DiffusionPipeline):
        pass

    with pytest.raises(TypeError, match=r"no policy for BarePipeline.*register_policy\(BarePipeline, YourPolicy\)"):
        policy_class(BarePipeline())

    class MyFlux(FluxPipeline):
        pass

    class MyFluxPolicy(FluxPolicy):
        pass

    pipeline = TINY_PIPELINES["flux"](0)
    pipeline.__class__ = MyFlux  # an unregistered subclass takes its nearest registered base's policy...
    assert policy_class(pipeline) is FluxPolicy
    register_policy(MyFlux, MyFluxPolicy)  # ...until it has its own
    assert policy_class(pipeline) is MyFluxPolicy
    with pytest.raises(TypeError, match="DiffusionPolicy subclass"):
        register_policy(MyFlux, object)
    with pytest.raises(TypeError, match="DiffusionPipeline or ModularPipeline subclass"):
        register_policy("FluxPipeline", MyFluxPolicy)


def test_z_image_guidance_one_is_cfg_and_says_so(caplog):
    """Z-Image's pipeline turns CFG off at 0, not 1: 1.0 (other families' no-CFG, several methods' default) warns."""
    settings = SamplerSettings(height=32, width=32, guidance_scale=1.0, max_sequence_length=16)
    assert make_policy(TINY_PIPELINES["z-image"](0), settings).use_cfg
    assert "on Z-Image is classifier-free guidance" in caplog.text
    caplog.clear()
    assert not make_policy(TINY_PIPELINES["z-image"](0), settings.__class__(guidance_scale=0.0)).use_cfg
    assert "classifier-free" not in caplog.text


LTX2_LEGACY = {  # guidance as diffusers' own LTX-2 tests pin it: CFG only
    "stg_scale": 0.0,
    "modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_stg_scale": 0.0,
    "audio_modality_scale": 1.0,
    "audio_guidance_rescale": 0.0,
}


@pytest.mark.parametrize(
    ("guidance", "negative_prompt", "pipeline_kwargs"),
    [
        (1.0, None, {**LTX2_LEGACY, "audio_guidance_scale": 1.0}),  # no guidance at all: one forward a step
        (3.0, "blurry, dark", {**LTX2_LEGACY, "audio_guidance_scale": 7.0}),  # CFG, its own scale for the audio
        (3.0, None, {"spatio_temporal_guidance_blocks": [1]}),  # the defaults: + STG + modality isolation + rescale
        (3.0, None, {}),  # the defaults as shipped: STG at block 28, beyond the tiny model's two (skipped)
        (1.0, None, {"frame_rate": 12.0, "motion_speed": 0.5, "use_cross_timestep": False, "stg_scale": 0.5}),
    ],
)
def test_ltx2_reproduces_the_pipeline(guidance, negative_prompt, pipeline_kwargs):
    """LTX-2: video and audio latents from the same generators as the pipeline's, the pipeline's guidance in x0
    space with every term, both modalities stepped together; the decoded video and the audio latents equal."""
    _assert_ltx2_reproduces_pipeline("ltx2", guidance, negative_prompt, pipeline_kwargs)


@pytest.mark.parametrize(
    ("guidance", "pipeline_kwargs"),
    [
        (1.0, {**LTX2_LEGACY, "audio_guidance_scale": 1.0}),
        (3.0, {"spatio_temporal_guidance_blocks": [1]}),  # every guidance term
    ],
)
def test_ltx2_image_to_video_reproduces_the_pipeline(guidance, pipeline_kwargs):
    """LTX-2 image-to-video: the image's latents as the first latent frame at timestep 0 (re-compression off:
    ``image_crf`` 0), every guidance term over the rows with the image in, the other tokens and the audio stepped."""
    _assert_ltx2_reproduces_pipeline("ltx2-i2v", guidance, None, {**pipeline_kwargs, "image_crf": 0})


@pytest.mark.parametrize(
    ("guidance", "pipeline_kwargs", "keyframe"),
    [
        (1.0, {**LTX2_LEGACY, "audio_guidance_scale": 1.0}, False),  # the first frame only: image-to-video
        (1.0, {**LTX2_LEGACY, "audio_guidance_scale": 1.0}, True),  # and a keyframe at the last latent frame
        (3.0, {"spatio_temporal_guidance_blocks": [1]}, True),  # every guidance term
    ],
)
def test_ltx2_condition_reproduces_the_pipeline(guidance, pipeline_kwargs, keyframe):
    """LTX2ConditionPipeline with frame conditions of strength 1: the first frame's tokens replaced and (``last_image``)
    a keyframe at the last latent frame appended as tokens with its own positions, both at timestep 0 and given; the
    pipeline draws a batch's noise from one generator, so it runs per prompt. Frames and waveforms equal; the
    keyframe changes them."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    pipeline = TINY_PIPELINES["ltx2-condition"](0)
    pipeline_kwargs = {**pipeline_kwargs, "image_crf": 0}
    settings = _deterministic(
        guidance, None, num_frames=TINY_VIDEO_FRAMES, max_sequence_length=32, pipeline_kwargs=pipeline_kwargs
    )
    policy = make_policy(pipeline, settings)
    policy.use_condition_columns(["prompt", "image", *(["last_image"] if keyframe else [])])
    images = tiny_condition_images(2 * len(PROMPTS))
    columns = {"image": images[: len(PROMPTS)]} | ({"last_image": images[len(PROMPTS) :]} if keyframe else {})
    with torch.no_grad():
        latents = policy.initial_noise([torch.Generator().manual_seed(i) for i in range(len(PROMPTS))])
        cond = policy.encode_prompts(list(PROMPTS), **columns)
        for i in range(policy.num_steps):
            output = policy.predict(policy.denoiser, latents, cond, at=i)
            latents = policy.step(output, latents, torch.full((len(PROMPTS),), i), compute_log_prob=False).prev_sample
        latents = policy.final_latents(latents, cond)
        ours, audio = policy.decode(latents), policy.decode_audio(latents)
        del pipeline_kwargs["image_crf"]
        for index, prompt in enumerate(PROMPTS):
            conditions = [LTX2VideoCondition(frames=images[index], index=0, crf=0)]
            if keyframe:
                conditions.append(LTX2VideoCondition(frames=images[len(PROMPTS) + index], index=-1, crf=0))
            expected = pipeline(
                prompt=[prompt], negative_prompt=[""], conditions=conditions, height=32, width=32,
                num_frames=TINY_VIDEO_FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
                max_sequence_length=32, generator=torch.Generator().manual_seed(index), output_type="pt",
                **pipeline_kwargs,
            )  # fmt: skip
            torch.testing.assert_close(ours[index : index + 1], expected.frames, rtol=0, atol=1e-5)
            torch.testing.assert_close(audio[index : index + 1], expected.audio, rtol=0, atol=1e-5)
            if keyframe:
                without = pipeline(
                    prompt=[prompt], negative_prompt=[""], conditions=conditions[:1], height=32, width=32,
                    num_frames=TINY_VIDEO_FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(index), output_type="pt",
                    **pipeline_kwargs,
                ).frames  # fmt: skip
                assert (without - expected.frames).abs().max() > 1e-3


def _assert_ltx2_reproduces_pipeline(kind, guidance, negative_prompt, pipeline_kwargs):
    pipeline = TINY_PIPELINES[kind](0)
    settings = _deterministic(
        guidance,
        negative_prompt,
        num_frames=TINY_VIDEO_FRAMES,
        max_sequence_length=32,
        pipeline_kwargs=pipeline_kwargs,
    )
    policy = make_policy(pipeline, settings)
    columns, image_input = {}, {}
    if kind == "ltx2-i2v":  # one image per prompt (the pipeline indexes them by its per-sample generators)
        (image,) = tiny_condition_images(1)
        columns = {"image": [image] * len(PROMPTS)}
        image_input = columns
    generators = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    with torch.no_grad():
        initial = policy.initial_noise(generators)
        cond = policy.encode_prompts(PROMPTS, **columns)
        latents = initial
        for i in range(policy.num_steps):
            index = torch.full((latents.shape[0],), i)
            output = policy.predict(policy.denoiser, latents, cond, at=i)
            latents = policy.step(output, latents, index, compute_log_prob=False).prev_sample
        latents = policy.final_latents(latents, cond)
        ours, audio = policy.decode(latents), policy.decode_audio(latents)
        expected = pipeline(
            prompt=PROMPTS,
            negative_prompt=[negative_prompt or ""] * len(PROMPTS),
            height=32,
            width=32,
            num_frames=TINY_VIDEO_FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            max_sequence_length=32,
            generator=[torch.Generator().manual_seed(i) for i in range(len(PROMPTS))],
            output_type="pt",
            **image_input,
            **pipeline_kwargs,
        )
    assert ours.shape == expected.frames.shape == (2, TINY_VIDEO_FRAMES, 3, 32, 32)
    torch.testing.assert_close(ours, expected.frames, rtol=0, atol=1e-5)
    torch.testing.assert_close(audio, expected.audio, rtol=0, atol=1e-5)
    assert policy.audio_sample_rate == pipeline.vocoder.config.output_sampling_rate


def test_pipeline_kwargs_the_policy_does_not_reproduce_are_refused():
    settings = SamplerSettings(height=32, width=32, num_frames=TINY_VIDEO_FRAMES, max_sequence_length=16)
    with pytest.raises(ValueError, match=r"pipeline_kwargs \['stg_scale'\] are not arguments FluxPolicy reproduces"):
        make_policy(TINY_PIPELINES["flux"](0), SamplerSettings(height=32, width=32, pipeline_kwargs={"stg_scale": 0}))
    ltx2 = TINY_PIPELINES["ltx2"](0)
    with pytest.raises(
        ValueError, match=r"\['decode_timestep'\] are not arguments LTX2Policy reproduces .*frame_rate"
    ):
        make_policy(ltx2, dataclasses.replace(settings, pipeline_kwargs={"decode_timestep": 0.05}))
    with pytest.raises(ValueError, match="max_sequence_length 20 must be a multiple of the 8 learnable registers"):
        make_policy(ltx2, dataclasses.replace(settings, max_sequence_length=20))
    with pytest.raises(ValueError, match="height=33 must be a multiple of 2"):  # the VAE's factor (32 in the real one)
        make_policy(ltx2, dataclasses.replace(settings, height=33))
