"""Capture what every tiny family's policy computes and what short tiny recipe runs log, to show a refactor changes
nothing: run it before and after, then compare the two JSON files (``--compare A B``); every value is a SHA-256 of the
tensor's bytes (or the logged number), so "equal" means bit-identical.

    python benchmarks/behaviour_capture.py before.json               # policies of every tiny family + tiny recipes
    python benchmarks/behaviour_capture.py after.json --policies     # policies only (about a minute)
    python benchmarks/behaviour_capture.py --compare before.json after.json

Per family: a 4-step rollout with SDE steps (latents, log-probabilities, images), a prediction at a trainable step,
the step's log-probability gradient scale, the forward process (noise, target, training times, deterministic step,
clean recovery, timesteps), the posterior sample of encoding the images, the FLOP token counts. Per recipe: the
log_history of a 2-round run without its timing entries.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile

import torch

TIMING = ("runtime", "per_second", "perf/", "time", "flos", "mfu", "tflops", "seconds", "/s")


def digest(value) -> str:
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous().cpu()
        return hashlib.sha256(value.numpy().tobytes()).hexdigest()[:16] + f":{tuple(value.shape)}"
    if isinstance(value, dict):
        return {key: digest(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(item) for item in value]
    return repr(value)


def _predict(policy, model, latents, at, cond):
    try:  # the policy-from-parts API, else the one before it
        return policy.predict(model, latents, cond, at=at)
    except TypeError:
        return policy.predict(model, latents, at, cond)


@contextlib.contextmanager
def small_edit_sources():
    """Qwen-Image-Edit's source images at 32² and 28² instead of 1024² and 384² (as the suite's fixture)."""
    from unittest import mock

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from trl_dance.policies import QwenImageEditPlusPolicy, QwenImageEditPolicy

    real = edit.calculate_dimensions
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(edit, "calculate_dimensions", lambda a, r: real(min(a, 1024), r)))
        stack.enter_context(mock.patch.object(plus, "VAE_IMAGE_SIZE", 1024))
        stack.enter_context(mock.patch.object(plus, "CONDITION_IMAGE_SIZE", 784))
        stack.enter_context(mock.patch.object(QwenImageEditPolicy, "source_image_area", 1024))
        stack.enter_context(mock.patch.object(QwenImageEditPlusPolicy, "prompt_image_area", 784))
        yield


def capture_policy(kind: str) -> dict:
    with small_edit_sources() if kind.startswith("qwen-image-edit") else contextlib.nullcontext():
        return _capture_policy(kind)


def _capture_policy(kind: str) -> dict:
    from trl_dance.policies import SamplerSettings, make_policy
    from trl_dance.sampling import RolloutPlan, generate, sample_generators
    from trl_dance.testing import TINY_PIPELINES, TINY_VIDEO_FRAMES, tiny_condition_images

    torch.manual_seed(0)
    pipeline = TINY_PIPELINES[kind](0)
    video = kind.startswith(("wan", "hunyuan", "skyreels", "ltx2"))
    length = 64 if kind.startswith("qwen-image-edit") or kind == "qwen-image21" else 32
    cfg = kind not in ("flux", "flux-kontext", "flux2", "flux2-klein")
    settings = SamplerSettings(
        num_inference_steps=4, height=32, width=32, guidance_scale=4.0 if cfg else 3.5, eta=1.0,
        max_sequence_length=length, num_frames=TINY_VIDEO_FRAMES if video else None,
        pipeline_kwargs={"image_crf": 0} if kind == "ltx2-i2v" else None,  # (its H.264 re-compression needs PyAV)
    )  # fmt: skip
    policy = make_policy(pipeline, settings).to("cpu")
    model = policy.denoiser
    columns = {name: tiny_condition_images(2) for name in policy.condition_columns}
    out = {}
    with torch.no_grad():
        cond = policy.encode_prompts(["a red cat", "a blue dog"], **columns)
        out["cond"] = digest(cond)
        result = generate(policy, model, sample_generators(0, 0, 0, 2), cond, RolloutPlan(4, 0, 3))
        out["rollout"] = digest({key: result[key] for key in ("latents", "log_probs", "final_latents", "images")})
        latents = result["latents"][:, 1]
        step = torch.tensor([1, 1])
        out["predict"] = digest(_predict(policy, model, latents, step, cond))
        process = getattr(policy, "process", policy)
        out["gradient_scale"] = digest(process.log_prob_gradient_scale(policy.trainable_steps()))
        x0, noise = result["final_latents"], torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
        t = torch.tensor([0.3, 0.7])
        for name, call in {
            "add_noise": lambda: process.add_noise(x0, noise, t),
            "target": lambda: process.training_target(x0, noise, t),
            "times": lambda: process.sample_training_times(4, torch.Generator().manual_seed(2), "cpu"),
            "det_step": lambda: process.deterministic_step(noise, latents, t, t - 0.2),
            "clean": lambda: process.recover_clean(latents, noise, t),
            "timestep_at": lambda: process.timestep_at(t),
            "model_timestep": lambda: process.model_timestep(step),
            "predicted_clean": lambda: process.predicted_clean(noise, latents, step),
            "encode": lambda: policy.encode_images(result["images"] * 2 - 1, torch.Generator().manual_seed(3)),
        }.items():
            try:
                out[name] = digest(call())
            except Exception as error:  # (what fails must fail alike)
                out[name] = f"{type(error).__name__}: {str(error)[:200]}"
    return out


RECIPES = {  # tiny recipe -> the tiny pipeline it names
    "grpo_flux_tiny": "flux", "grpo_sd_tiny": "sd", "ddpo_sd_tiny": "sd", "grpo_sd3_fast_tiny": "sd3",
    "grpo_flux_mix_tiny": "flux", "grpo_wan_tiny": "wan", "grpo_qwen_image_tiny": "qwen-image",
    "grpo_hunyuan_video15_tiny": "hunyuan-video15", "grpo_ltx2_tiny": "ltx2", "nft_flux_tiny": "flux",
    "nft_wan_tiny": "wan", "srpo_flux_tiny": "flux", "spo_sd_tiny": "sd", "online_dpo_sd3_tiny": "sd3",
    "dpo_sd3_tiny": "sd3", "sft_sd3_tiny": "sd3",
}  # fmt: skip


def capture_recipe(name: str, folder: str) -> list:
    import yaml

    from trl_dance.scripts import train
    from trl_dance.testing import save_tiny_pipeline

    path = f"recipes/configs/{name}.yaml"
    with open(path) as handle:
        recipe = yaml.safe_load(handle)
    model = os.path.join(folder, RECIPES[name])
    if not os.path.isdir(model):
        save_tiny_pipeline(RECIPES[name], model)
    argv = ["--config", path, "--max_steps", "2", "--output_dir", os.path.join(folder, name),
            "--model_name_or_path", model, "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1"]  # fmt: skip
    for key in ("ref_model_name_or_path", "teacher_model_name_or_path"):
        if key in recipe:
            argv += [f"--{key}", model]
    for key, value in recipe.items():  # the dataset recipes: a folder of pairs/images made on the fly
        if key == "dataset_name" and not os.path.isdir(str(value)):
            from trl_dance.testing import tiny_preference_dataset

            data = os.path.join(folder, "pairs-" + RECIPES[name])
            if not os.path.isdir(data):
                tiny_preference_dataset(RECIPES[name]).save_to_disk(data)
            argv += ["--dataset_name", data]
    trainer = train.main(argv)
    return [
        {key: value for key, value in entry.items() if not any(part in key for part in TIMING)}
        for entry in trainer.state.log_history
    ]


def compare(a: str, b: str) -> int:
    with open(a) as handle:
        before = json.load(handle)
    with open(b) as handle:
        after = json.load(handle)
    differences = 0
    for section in ("policies", "recipes"):
        for name in sorted(set(before.get(section, {})) & set(after.get(section, {}))):
            if before[section][name] != after[section][name]:
                differences += 1
                print(f"DIFFERENT {section}/{name}:\n  {before[section][name]}\n  {after[section][name]}")
            else:
                print(f"identical {section}/{name}")
    print(f"{differences} different")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?")
    parser.add_argument("--policies", action="store_true", help="policies only")
    parser.add_argument("--only", nargs="*", help="these tiny kinds / recipes only")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    from trl_dance.testing import TINY_PIPELINES

    torch.use_deterministic_algorithms(True)
    result = {"policies": {}, "recipes": {}}
    for kind in TINY_PIPELINES:
        if not args.only or kind in args.only:
            result["policies"][kind] = capture_policy(kind)
            print(kind, "done", flush=True)
    if not args.policies:
        with (
            tempfile.TemporaryDirectory() as folder,
            contextlib.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        ):
            for name in RECIPES:
                if not args.only or name in args.only:
                    try:
                        result["recipes"][name] = digest(capture_recipe(name, folder))
                    except Exception as error:  # (what fails must fail alike)
                        result["recipes"][name] = f"{type(error).__name__}: {str(error)[:200]}"
                    print(name, "done", flush=True)
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
