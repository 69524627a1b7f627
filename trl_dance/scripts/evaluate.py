"""``trl-dance eval``: a base pipeline against LoRAs or fine-tuned denoisers, on a prompt file, with any rewards.

    trl-dance eval --model_name_or_path black-forest-labs/FLUX.1-dev --prompts_file prompts.txt \\
        --checkpoints outputs/grpo-flux outputs/grpo-flux/checkpoint-500 --reward_funcs hpsv2 pickscore

Every model samples the same (prompt, seed) pairs with the deterministic sampler from the same noise, so its samples
are paired with the base's: per reward it prints the mean ± standard error and the win rate against the base (ties
count ½), and writes to ``output_dir`` an ``imagefolder`` dataset (``images/<model>/<i>.png`` and ``metadata.jsonl``
with the prompt, model, sample index and every reward: ``load_dataset("imagefolder", data_dir=output_dir)``) and the
table as ``results.md``. A checkpoint is a folder with ``pytorch_lora_weights.safetensors`` (a LoRA) or a saved
denoiser (``config.json`` + weights); ``--ema`` uses its ``ema/`` copy; a run folder without weights of its own
(unfinished) stands for its ``checkpoint-<N>`` folders. The models sample as the runs saved it (``--sampling
checkpoint``: their ``trl_dance_sampling.json``, steps, σ grid, guidance and size, so that a few-step student is
judged on its own grid), the flags overriding; ``--sampling pipeline``: the pipeline's grid and defaults.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl_dance.data import load_prompt_dataset
from trl_dance.lora import LORA_WEIGHTS_NAME, load_lora_into_pipeline, unload_lora_from_pipeline
from trl_dance.policies import DiffusionPolicy, SamplerSettings, make_policy
from trl_dance.rewards import resolve_reward_funcs, reward_name, score_images
from trl_dance.sampling import RolloutPlan, generate, mix_seed
from trl_dance.trainer.diffusion_trainer import load_pipeline
from trl_dance.trainer.evaluation import (
    SAMPLING_FILE,
    STOCHASTIC_SAMPLING_SDE,
    pipeline_call_defaults,
    read_sampling_record,
    sigma_grid,
)
from trl_dance.visualization import to_pil


@dataclass
class EvalArguments:
    model_name_or_path: str = field(metadata={"help": "The base pipeline: a Hub id or local folder."})
    prompts_file: str = field(metadata={"help": "Prompts: .txt (one per line) or .jsonl/.csv with a prompt column."})
    checkpoints: list[str] = field(
        default_factory=list, metadata={"help": "LoRA or denoiser folders to compare with the base."}
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["brightness"], metadata={"help": "Registered reward names or module.path:function."}
    )
    reward_kwargs: str | None = field(
        default=None, metadata={"help": "JSON: constructor arguments of model rewards, by reward name."}
    )
    output_dir: str = field(default="outputs/eval", metadata={"help": "Where the dataset and results.md go."})
    num_images_per_prompt: int = field(default=1, metadata={"help": "Samples per prompt (seeds 0..n-1)."})
    seed: int = field(default=0, metadata={"help": "Seed of the noise (the same for every model)."})
    num_inference_steps: int | None = field(default=None, metadata={"help": "Steps (default: the pipeline's)."})
    guidance_scale: float | None = field(default=None, metadata={"help": "Guidance (default: the pipeline's)."})
    negative_prompt: str | None = field(default=None, metadata={"help": "Negative prompt (CFG families)."})
    height: int | None = field(default=None, metadata={"help": "Height in pixels (default: the pipeline's)."})
    width: int | None = field(default=None, metadata={"help": "Width in pixels (default: the pipeline's)."})
    num_frames: int | None = field(default=None, metadata={"help": "Frames of video models."})
    max_sequence_length: int | None = field(default=None, metadata={"help": "T5 prompt tokens (default 512)."})
    sampling: str = field(
        default="checkpoint",
        metadata={
            "help": "checkpoint: sample as the runs saved it (trl_dance_sampling.json: steps, σ grid, guidance, "
            "size), flags overriding; pipeline: the pipeline's own grid and defaults.",
            "choices": ["checkpoint", "pipeline"],
        },
    )
    batch_size: int = field(default=4, metadata={"help": "Samples generated together."})
    dtype: str | None = field(default=None, metadata={"help": "Load the pipeline in this dtype (e.g. bfloat16)."})
    device: str | None = field(default=None, metadata={"help": "Default: cuda if available, else cpu."})
    ema: bool = field(default=False, metadata={"help": "Use each checkpoint's ema/ weights."})


def _label(path: str, taken: set[str]) -> str:
    """A short unique name of a checkpoint folder: its last two path components."""
    parts = os.path.normpath(path).split(os.sep)
    label = "/".join(parts[-2:]).replace("/", "-") if len(parts) > 1 else parts[-1]
    while label in taken or label == "base":
        label += "_"
    return label


@contextlib.contextmanager
def _weights_of(policy: DiffusionPolicy, checkpoint: str | None):
    """The pipeline with ``checkpoint``'s LoRA loaded or its denoiser swapped in (nothing for the base)."""
    pipeline = policy.pipeline
    if checkpoint is None:
        yield
        return
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"checkpoint {checkpoint!r} is not a folder")
    if os.path.isfile(os.path.join(checkpoint, LORA_WEIGHTS_NAME)):
        load_lora_into_pipeline(pipeline, policy.denoiser_name, policy.lora_name, checkpoint)
        try:
            yield
        finally:
            unload_lora_from_pipeline(pipeline, policy.denoiser_name)
        return
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(f"checkpoint {checkpoint!r} holds neither {LORA_WEIGHTS_NAME} nor a saved denoiser")
    base = policy.denoiser
    trained = type(base).from_pretrained(checkpoint, dtype=base.dtype).to(base.device)
    setattr(pipeline, policy.denoiser_name, trained)
    try:
        yield
    finally:
        setattr(pipeline, policy.denoiser_name, base)


def _sample_and_score(
    policy, rows, funcs, args: EvalArguments, label: str, stochastic: bool = False
) -> tuple[torch.Tensor, list]:
    """(n, F) rewards of every row's sample and the images as PIL, each row sampled from its own seeded noise (and,
    ``stochastic``, its own seeded noise at each step)."""
    plan = RolloutPlan(policy.num_steps) if stochastic else RolloutPlan.deterministic(policy.num_steps)
    device_type = policy.device.type
    autocast = policy.denoiser.dtype != torch.float32
    scores, images = [], []
    for start in tqdm(range(0, len(rows), args.batch_size), desc=f"generating and scoring {label}"):
        chunk = rows[start : start + args.batch_size]
        prompts = [row["prompt"] for row in chunk]
        columns = {key: [row[key] for row in chunk] for key in chunk[0] if key not in ("prompt", "sample")}
        conditions = {name: columns[name] for name in policy.condition_columns}
        generators = [torch.Generator().manual_seed(mix_seed(args.seed, row["sample"])) for row in chunk]
        with torch.autocast(device_type, dtype=policy.denoiser.dtype, enabled=autocast):
            cond = policy.encode_prompts(prompts, **conditions)
            batch = generate(policy, policy.denoiser, generators, cond, plan)["images"]
        scores.append(score_images(funcs, prompts, batch, columns))
        images += to_pil(batch)
    return torch.cat(scores).cpu(), images


def _table(names: list[str], results: dict[str, torch.Tensor]) -> list[str]:
    """A markdown table: per model and reward, mean ± standard error, and the win rate against the base."""
    header = ["model", *[f"{name} (mean ± s.e.)" for name in names], *[f"{name} win rate vs base" for name in names]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = results["base"]
    for label, scores in results.items():
        n = scores.shape[0]
        cells = [label]
        for column in range(len(names)):
            values = scores[:, column].double()
            error = values.std().item() / math.sqrt(n) if n > 1 else float("nan")
            cells.append(f"{values.mean().item():.4f} ± {error:.4f}")
        for column in range(len(names)):
            if label == "base":
                cells.append("–")
                continue
            ours, theirs = scores[:, column], base[:, column]
            wins = (ours > theirs).double() + 0.5 * (ours == theirs).double()
            cells.append(f"{wins.mean().item():.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _expand_run_folders(checkpoints: list[str]) -> list[str]:
    """Each folder as given, but a run folder without weights of its own (a run still training, or stopped before its
    final save) becomes its ``checkpoint-<N>`` folders, by step."""
    expanded = []
    for folder in checkpoints:
        steps = sorted(
            (int(name.split("-")[-1]), os.path.join(folder, name))
            for name in (os.listdir(folder) if os.path.isdir(folder) else [])
            if name.startswith(PREFIX_CHECKPOINT_DIR + "-") and name.split("-")[-1].isdigit()
        )
        weights = any(os.path.isfile(os.path.join(folder, name)) for name in (LORA_WEIGHTS_NAME, "config.json"))
        expanded += [path for _, path in steps] if steps and not weights else [folder]
    return expanded


def _recorded_sampling(checkpoints: list[str]) -> dict | None:
    """The one sampling record (:data:`~trl_dance.trainer.evaluation.SAMPLING_FILE`) the checkpoints carry; refused
    where they differ (their samples would not be paired)."""
    records = {}
    for folder in checkpoints:
        if (record := read_sampling_record(folder)) is not None:
            records.setdefault(json.dumps(record, sort_keys=True), []).append(folder)
    if len(records) > 1:
        ways = "; ".join(f"{folders[0]}: {json.loads(key)}" for key, folders in records.items())
        raise ValueError(
            f"the checkpoints were trained to sample differently ({ways}): evaluate them apart, or pass --sampling "
            "pipeline (or the settings themselves)"
        )
    return json.loads(next(iter(records))) if records else None


def _tiny_sampling(args) -> dict:
    """The sampling settings a tiny pipeline saved by ``trl-dance tiny`` carries (else none)."""
    from trl_dance.tiny_folders import TINY_SAMPLING_FILE

    path = os.path.join(args.model_name_or_path, TINY_SAMPLING_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as handle:
        tiny = {key: value for key, value in json.load(handle).items() if key != "kind"}
    print(
        f"a tiny pipeline: sampling defaults {tiny} (--height, --width, --num_inference_steps, --num_frames override)"
    )
    return tiny


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Run the comparison; returns each model's (n, F) rewards by label ("base" first)."""
    parser = HfArgumentParser(
        EvalArguments,
        prog="trl-dance eval",
        description="A base pipeline against LoRAs or fine-tuned denoisers, on a prompt file, with any rewards: the "
        "same (prompt, seed) pairs for every model, mean ± standard error and win rates against the base.",
    )
    (args,) = parser.parse_args_into_dataclasses(argv)
    if args.num_images_per_prompt < 1 or args.batch_size < 1:
        raise ValueError("num_images_per_prompt and batch_size must be >= 1")
    dataset = load_prompt_dataset(args.prompts_file)
    rows = [
        {**row, "sample": index * args.num_images_per_prompt + k}
        for index, row in enumerate(dataset)
        for k in range(args.num_images_per_prompt)
    ]
    kwargs = json.loads(args.reward_kwargs) if args.reward_kwargs else {}
    funcs = resolve_reward_funcs(args.reward_funcs, kwargs)  # as the trainers resolve them
    names = [reward_name(func) for func in funcs]

    # As the trainers load it (tiny folders, and a mistyped path named as such rather than "not cached").
    load = {"dtype": args.dtype} if args.dtype else {}
    pipeline = load_pipeline(args.model_name_or_path, SimpleNamespace(model_init_kwargs=load))
    defaults = pipeline_call_defaults(pipeline)
    size = getattr(pipeline, "default_sample_size", None)
    scale = getattr(pipeline, "vae_scale_factor", None) or getattr(pipeline, "vae_scale_factor_spatial", 8)
    resolution = size * scale if size else 512
    defaults |= {"height": resolution, "width": resolution, "max_sequence_length": 512} | _tiny_sampling(args)
    checkpoints = _expand_run_folders(args.checkpoints)
    recorded = _recorded_sampling(checkpoints) if args.sampling == "checkpoint" else None
    if recorded is not None:  # a few-step student samples on its own grid, not the pipeline's
        print(f"sampling as the checkpoints were trained to ({SAMPLING_FILE}; flags override): {recorded}")
        defaults |= {key: value for key, value in recorded.items() if value is not None and key != "sigmas"}
    # DMD2's re-noising students sample with fresh noise at each step, seeded as the starts are
    stochastic = bool(recorded and recorded.get("stochastic_sampling"))
    given = {name: getattr(args, name) for name in ("num_inference_steps", "guidance_scale", "height", "width",
                                                    "num_frames", "negative_prompt", "max_sequence_length")}  # fmt: skip
    chosen = defaults | {name: value for name, value in given.items() if value is not None}
    settings = SamplerSettings(
        num_inference_steps=chosen.get("num_inference_steps", 28),
        guidance_scale=chosen.get("guidance_scale", 1.0),
        height=chosen["height"],
        width=chosen["width"],
        sigma_schedule=chosen.get("sigma_schedule", "pipeline"),
        shift=chosen.get("shift", SamplerSettings.shift),
        negative_prompt=chosen.get("negative_prompt"),
        max_sequence_length=chosen["max_sequence_length"],
        num_frames=chosen.get("num_frames"),
        guidance_scale_2=chosen.get("guidance_scale_2"),
        **(STOCHASTIC_SAMPLING_SDE if stochastic else {}),
    )
    policy = make_policy(pipeline, settings)
    policy.use_condition_columns(dataset.column_names)  # (Qwen-Image 2.1's optional condition image)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipeline.to(device)

    labels = {"base": None}
    for checkpoint in checkpoints:
        labels[_label(checkpoint, set(labels))] = os.path.join(checkpoint, "ema") if args.ema else checkpoint
    os.makedirs(args.output_dir, exist_ok=True)
    results, records = {}, []
    with torch.no_grad():
        for label, checkpoint in labels.items():
            with _weights_of(policy, checkpoint):
                scores, images = _sample_and_score(policy, rows, funcs, args, label, stochastic)
            results[label] = scores
            folder = os.path.join(args.output_dir, "images", label)
            os.makedirs(folder, exist_ok=True)
            for row, image, score in zip(rows, images, scores.tolist()):
                name = os.path.join("images", label, f"{row['sample']:05d}.png")
                image.save(os.path.join(args.output_dir, name))
                record = {"file_name": name, "model": label, "prompt": row["prompt"], "sample": row["sample"]}
                records.append(record | dict(zip(names, score)))
    with open(os.path.join(args.output_dir, "metadata.jsonl"), "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    lines = _table(names, results)
    sigmas = sigma_grid(policy)
    grid = "(" + ", ".join(f"{value:.4g}" for value in sigmas) + ")" if sigmas is not None else ""
    sources = "\n".join(f"- {label}: {checkpoint or args.model_name_or_path}" for label, checkpoint in labels.items())
    note = (
        f"{len(rows)} samples per model ({len(dataset)} prompts × {args.num_images_per_prompt}), seed {args.seed}, "
        f"{settings.num_inference_steps} steps, guidance {settings.guidance_scale}, {settings.height}×{settings.width}, "
        f"{settings.sigma_schedule} σ grid {grid}"
    )
    with open(os.path.join(args.output_dir, "results.md"), "w", encoding="utf-8") as handle:
        handle.write("\n".join([*lines, "", note, "", sources, ""]))
    print("\n".join([*lines, "", note]))
    print(f"wrote {args.output_dir}: results.md, metadata.jsonl, images/ (load_dataset('imagefolder', data_dir=...))")
    return results


if __name__ == "__main__":
    main()
