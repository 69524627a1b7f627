import json
import os
import tempfile

# Before anything imports huggingface_hub, which reads these once: no test may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Idle OpenMP threads sleep (as under the trl-dance entry points), here and in every process a test launches.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# trackio also reads its directory at import: a private one per test process, never the user's cache.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-")

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_dance.lora import load_lora_into_pipeline  # noqa: E402
from trl_dance.testing import TINY_VIDEO_FRAMES, load_tiny_pipeline, save_tiny_pipeline  # noqa: E402

# Two pytest-xdist workers share two cores: one intra-op thread each. TRL_DANCE_TEST_THREADS and
# TRL_DANCE_TEST_SEED let benchmarks/learning_spread.py rerun the learning tests under other reduction orders and
# noise streams, which is how their margins were measured.
torch.set_num_threads(int(os.environ.get("TRL_DANCE_TEST_THREADS", "1")))
LEARNING_SEED = int(os.environ.get("TRL_DANCE_TEST_SEED", "42"))


# The fast tier, -m "not slow": the learning tests carry the marker themselves, and the tests a measured whole-suite run
# found heavy (tests/heavy_tests.txt, written by benchmarks/suite_tiers.py) get it here.
HEAVY_TESTS = os.path.join(os.path.dirname(__file__), "heavy_tests.txt")


def pytest_collection_modifyitems(config, items):
    with open(HEAVY_TESTS) as handle:
        heavy = {line.strip() for line in handle if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in heavy:
            item.add_marker(pytest.mark.slow)


PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]
# Attention plus output projections (FLUX proj_mlp, UNet conv_out); names a family lacks are skipped by peft.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out", "proj_mlp", "conv_out"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Saved tiny pipelines, loaded by the trainers through DiffusionPipeline.from_pretrained like a Hub id."""
    root = tmp_path_factory.mktemp("tiny-pipelines")
    cache = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = save_tiny_pipeline(kind, str(root / kind))
        return cache[kind]

    return get


def family_overrides(kind: str) -> dict:
    """Config values a tiny family needs beyond :func:`tiny_grpo_config`'s: short videos for Wan and HunyuanVideo,
    room for the source image's tokens in Qwen-Image-Edit's prompt embeddings (and Qwen-Image 2.1's template)."""
    if kind.startswith("qwen-image-edit"):
        return {"max_sequence_length": 64}
    if kind == "qwen-image21":  # (its template's tokens; a condition image read at the tiny output size)
        return {"max_sequence_length": 64, "pipeline_kwargs": {"output_resolution": 32}}
    if kind == "ltx2":  # (a multiple of the connectors' learnable registers)
        return {"num_frames": TINY_VIDEO_FRAMES, "max_sequence_length": 32}
    if kind == "minimax-h3":  # (its shortest clip; its two shipped σ grids)
        return {"num_frames": 124, "max_sequence_length": 32, "sigma_schedule": "pipeline"}
    return {"num_frames": TINY_VIDEO_FRAMES} if kind.startswith(("wan", "hunyuan", "skyreels")) else {}


SMALL_SOURCE_AREA, SMALL_PROMPT_IMAGE_AREA = 32 * 32, 28 * 28


@pytest.fixture
def small_edit_sources(monkeypatch):
    """Qwen-Image-Edit's source images at the tiny output's 32² (the VAE's) and 28² (the text encoder's), in the
    policies and the pipelines, instead of the pipelines' fixed 1024² and 384² (65k source tokens on the tiny VAE)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from trl_dance.policies import QwenImageEditPlusPolicy, QwenImageEditPolicy

    real = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: real(min(area, SMALL_SOURCE_AREA), ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", SMALL_SOURCE_AREA)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", SMALL_PROMPT_IMAGE_AREA)
    monkeypatch.setattr(QwenImageEditPolicy, "source_image_area", SMALL_SOURCE_AREA)
    monkeypatch.setattr(QwenImageEditPlusPolicy, "prompt_image_area", SMALL_PROMPT_IMAGE_AREA)


def tiny_online_values(output_dir) -> dict:
    """What every online trainer's tiny test config has: CPU, no saving or trackers, 2 groups of 4 samples at 32×32
    with 6 steps, 2 rounds."""
    return {
        "output_dir": str(output_dir),
        "bf16": False,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "num_generations": 4,
        "generation_batch_size": 8,
        "num_inference_steps": 6,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "per_device_train_batch_size": 8,
        "learning_rate": 3e-2,
        "max_steps": 2,
    }


def tiny_grpo_config(output_dir, **overrides):
    from trl_dance import DanceGRPOConfig

    values = tiny_online_values(output_dir) | {
        "gradient_accumulation_steps": 5,  # the 5 micro-batches of a round (8 samples x 5 steps / 8)
        "timestep_fraction": 1.0,
        "eta": 1.0,
    }
    return DanceGRPOConfig(**(values | overrides))


def tiny_dpo_config(tmp_path, **overrides):
    """A Diffusion-DPO config for the tiny pipelines: CPU, 32 px, 8 pairs per step, 2 steps, written under
    ``tmp_path / "out"``."""
    from trl_dance import DiffusionDPOConfig

    values = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 5,
        "resolution": 32,
        "max_sequence_length": 32,
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "max_steps": 2,
        "seed": 0,
    }
    return DiffusionDPOConfig(**(values | overrides))


def recomputed_steps(trainer, grad: bool = False):
    """(inputs, output, step) of every transition planned for the last round, recomputed by the policy as the loss
    does (with ``grad``, with gradients: a compiled module runs another graph then)."""
    for plan in trainer._microbatches:
        inputs = trainer._microbatch(plan)
        with torch.set_grad_enabled(grad):
            output = trainer.policy.predict(trainer.model, inputs["latents"], inputs["cond"], at=inputs["step_index"])
            step = trainer.policy.step(
                output, inputs["latents"], inputs["step_index"], prev_sample=inputs["next_latents"]
            )
        yield inputs, output, step


def max_ratio_deviation(trainer, grad: bool = False) -> float:
    """max |ρ − 1| over the transitions planned for the last round, each log-prob recomputed (with gradients if
    ``grad``) against the one the rollout stored."""
    return max(
        (step.log_prob.detach() - inputs["old_log_prob"]).exp().sub(1).abs().max().item()
        for inputs, _, step in recomputed_steps(trainer, grad)
    )


def assert_given_prefix_is_held(trainer, given: int) -> None:
    """The first ``given`` elements of every row (a given frame, keyframe tokens, anchor noise) never move along the
    last rollout's trajectories, and moving them in a transition's next state leaves its log-probability unchanged."""
    trajectory = trainer._rollout["latents"]  # (B, N, D)
    assert torch.equal(trajectory[:, 1:, :given], trajectory[:, :1, :given].expand_as(trajectory[:, 1:, :given]))
    policy, inputs = trainer.policy, trainer._microbatch(trainer._microbatches[0])
    with torch.no_grad():
        output = policy.predict(trainer.model, inputs["latents"], inputs["cond"], at=inputs["step_index"])
        moved = inputs["next_latents"].clone()
        moved[:, :given] += 1.0
        scores = [
            policy.step(output, inputs["latents"], inputs["step_index"], prev_sample=x).log_prob
            for x in (inputs["next_latents"], moved)
        ]
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=0)


def assert_learned(metric: str, first: float, last: float, noise: float, margin: float) -> None:
    """A learning test's verdict: the gain of ``metric`` ``last − first`` exceeds ``margin`` and twice the sample std
    ``noise``. Each verdict is also appended, as a JSON line, to $TRL_DANCE_LEARNING_LOG when set (xdist workers
    print nothing), so that benchmarks/learning_spread.py can tabulate gains across seeds and thread counts."""
    first, last, noise = float(first), float(last), float(noise)
    gain = last - first
    record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "metric": metric, "seed": LEARNING_SEED}
    record |= {"threads": torch.get_num_threads(), "first": first, "last": last, "gain": gain, "noise": noise}
    record["margin"] = margin
    print(f"learning: {record}")
    if os.environ.get("TRL_DANCE_LEARNING_LOG"):
        with open(os.environ["TRL_DANCE_LEARNING_LOG"], "a") as log:
            log.write(json.dumps(record) + "\n")
    assert gain > margin and gain > 2 * noise, record


def assert_saved_lora_reproduces_training(trainer, model_dir: str, lora_dir: str, prompts: list, **columns) -> None:
    """The LoRA ``trainer`` saved in ``lora_dir``, loaded into a fresh pipeline from ``model_dir`` with diffusers'
    ``load_lora_weights``, predicts on ``prompts`` (and condition ``columns``) what the trained model predicts (to
    1e-5), and training changed the prediction. Each policy encodes the conditioning itself."""

    from trl_dance.policies import SamplerSettings, make_policy

    settings = SamplerSettings.from_config(trainer.args)
    batch = len(prompts)
    latents = trainer.policy.initial_noise([torch.Generator().manual_seed(i) for i in range(batch)])
    steps = torch.tensor([0, 3] * (batch // 2) + [1] * (batch % 2))
    base, reloaded = load_tiny_pipeline(model_dir), load_tiny_pipeline(model_dir)
    load_lora_into_pipeline(reloaded, trainer.policy.denoiser_name, trainer.policy.lora_name, lora_dir)

    def predict(policy, model):
        return policy.predict(model, latents, policy.encode_prompts(prompts, **columns), at=steps)

    policies = {"loaded": make_policy(reloaded, settings), "base": make_policy(base, settings)}
    for policy in policies.values():  # (an optional condition column, as the trainer takes it)
        policy.use_condition_columns(list(columns))
    with torch.no_grad():
        trained = predict(trainer.policy, trainer.model)
        loaded = predict(policies["loaded"], reloaded.transformer)
        base_out = predict(policies["base"], base.transformer)
    assert (trained - base_out).abs().max() > 1e-3  # training changed the model...
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)  # ...and the saved LoRA reproduces it


def train_and_assert_reward_rose(trainer, metric: str, margin: float) -> None:
    """Train, then :func:`assert_learned` on the rollouts' logged ``reward``: the mean of the last 3 rounds against the
    first 3, beyond the first round's sample std."""
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"per round {rewards}")
    noise = trainer.state.log_history[0]["reward_std"]
    assert_learned(metric, sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3, noise, margin)


def train_and_resume(make_trainer, output_dir, **overrides):
    """Train 3 optimizer updates checkpointing after each, then train again from ``checkpoint-1``; assert both runs
    end with bit-identical model weights and return (full, resumed) for the caller's own state comparisons. An update
    per micro-batch (``gradient_accumulation_steps=1``, unless overridden) puts ``checkpoint-1`` inside a round of
    several updates (asserted): the round's rollout must travel with the checkpoint.
    ``make_trainer(output_dir, **overrides)`` builds a trainer."""
    overrides = {
        "max_steps": 3,
        "save_strategy": "steps",
        "save_steps": 1,
        "gradient_accumulation_steps": 1,
    } | overrides
    full = make_trainer(output_dir, **overrides)
    if overrides["gradient_accumulation_steps"] == 1:
        assert full.args.optimizer_updates_per_round > 1, "checkpoint-1 would be a round boundary"
    full.train()
    resumed = make_trainer(output_dir, **overrides)
    resumed.train(resume_from_checkpoint=os.path.join(full.args.output_dir, "checkpoint-1"))
    for (name, value), other in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(value, other), name
    return full, resumed
