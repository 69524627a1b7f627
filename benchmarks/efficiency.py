"""Denoiser work and wall time each online RL method needs for the same reward gain, against DanceGRPO, in one run.

    python benchmarks/efficiency.py                          # tiny FLUX, brightness, one seed, CPU: about 4 minutes
    python benchmarks/efficiency.py --seeds 0 1 2            # the docs table (docs/methods/grpo.md): medians over 3 seeds (12 minutes)
    python benchmarks/efficiency.py --methods flow_grpo_fast  # one method (and DanceGRPO, which always runs)
    python benchmarks/efficiency.py --model flux-dev --bf16 --resolution 256    # a GPU, random weights

Every method starts from the same weights, LoRA initialisation, prompts and seeds, and differs only in its
trainer and config settings (``methods``, each the published recipe mapped to this task's N steps). After every
``--eval-every`` rounds, the policy is scored on fixed prompts and noises with the deterministic sampler (Euler ODE over
the full N-step grid), the same for all methods, so the gains compare policies, not samplers; evaluation is neither
counted as work nor timed.

Work counts denoiser rows: a forward without gradient (rollout, reference) 1, a forward with gradient (the training
forward and its backward) 3; beside it, the denoiser's TFLOPs as the trainers count them in closed form (their logged
``perf/denoiser_tflops``: LoRA's backward skips the frozen weights' gradients). The target gain is ``--target`` × DanceGRPO's best evaluation gain; each method's work
and wall time to reach it are interpolated linearly between evaluations (null if never reached).

Every method runs once per ``--seeds`` seed (noise streams and LoRA initialisation); the figures are medians over the
seeds of each seed's figures, ratios being DanceGRPO's figure over the method's in the same seed. The last line is JSON:
``{"methods": {name: {"work", "wall_s", "tflops", "work_ratio", "wall_ratio", "tflops_ratio", "work_ratio_per_seed", "wall_ratio_per_seed",
"final_gain", "best_gain", "work_per_round", "wall_s_per_round", "gains_per_seed"}}, "target_gains", "best_method",
"best_work_ratio", ...}``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from architectures import build_model, lora_config, release  # noqa: E402
from cli import add_model_arguments, emit, is_tiny, num_frames, resolution  # noqa: E402

from trl_dance import DanceGRPOTrainer, DiffusionNFTTrainer, DirectRewardTrainer  # noqa: E402
from trl_dance.sampling import RolloutPlan  # noqa: E402
from trl_dance.trainer.rollout_trainer import RolloutTrainer  # noqa: E402

PROMPTS = ["a cat", "a dog", "a red house", "blue sky", "green tree", "old car", "big ship", "sun set"]


def methods(steps: int, rounds: int) -> dict[str, tuple[type[RolloutTrainer], dict]]:
    """Each method's trainer and settings for an N-step schedule. Windows keep their published sizes; ranges scale with N
        (Flow-GRPO-Fast: the first half of the steps); MixGRPO's window sweeps the trainable steps once over the run (the
        paper: 1 step every 25 of 300 iterations). DiffusionNFT: its config's defaults (DPM-Solver++ rollouts on the
        pipeline's grid, ⌊0.99·N⌋ noise levels per sample, KL β 1e-4, the linear old-policy decay moved after every
        update), with ``updates_per_round`` optimizer updates per round where given (one otherwise, for every method;
        Flow-DPPO's rows take 4). DiffusionART: two updates per round (its two windows), all states or ART-Flash's 2
        highest-noise ones.
        Direct reward methods: deterministic rollouts, their
    config's SRPO defaults except as noted."""
    half = max(3, (steps - 1) // 2)
    fast = {"sde_type": "cps", "eta": 0.8, "sde_window_size": 2, "sde_window_range": [0, half]}
    fast |= {"timestep_fraction": 1.0}
    positions = steps - 1 - 4 + 1
    mix = {"sde_type": "flow_grpo", "eta": 0.7, "sde_window_size": 4, "timestep_fraction": 1.0}
    mix |= {"sde_window_schedule": "progressive", "sde_window_stride_rounds": max(1, rounds // positions)}
    grpo = {
        "dancegrpo": {},  # the config's defaults: DanceGRPO's FLUX recipe (η 0.3, 60 % of the steps)
        # Recompute-free: the same update through the rollout's own differentiable forwards (one update per round).
        "dancegrpo_rollout_backprop": {"rollout_backprop": True},
        "flow_grpo_fast": fast,
        "flow_grpo_fast_branching": fast | {"branching": True},
        # Ablation: Fast's window with DanceGRPO's SDE and noise level, to separate the window from the noise.
        "window_dance_sde": fast | {"sde_type": "dance", "eta": 0.3},
        "mixgrpo": mix,
        "mixgrpo_flash": mix | {"post_window_solver": "dpm_solver++", "post_window_step_ratio": 0.4},
        # Flow-DPPO: the KL trust region instead of the clip, 4 updates per round on the same rollouts.
        "dppo_4_updates": {"trust_region": "dppo", "updates_per_round": 4},
        "clip_4_updates": {"updates_per_round": 4},  # control: the ratio clip over the same 4 updates per round
        # Probe of what limits them: a trust region 1000× wider than Flow-DPPO's τ.
        "dppo_4_updates_tau_1e-3": {"trust_region": "dppo", "dppo_kl_threshold": 1e-3, "updates_per_round": 4},
        "dppo_fast_branching_4_updates": fast | {"branching": True, "trust_region": "dppo", "updates_per_round": 4},
        # Flash-GRPO: one SDE step per sample, placed per group in the first half, Flash SDE, rectified.
        "flash_grpo": {"sde_type": "flash", "eta": 1.0, "sde_window_size": 1, "sde_window_range": [0, half]}
        | {"timestep_selection": "iso_temporal", "temporal_rectification": True},
    }
    art_flash = {"loss_type": "art", "timestep_selection": "first", "timestep_fraction": 2 / steps}
    art_flash |= {"updates_per_round": 2}
    return {name: (DanceGRPOTrainer, settings) for name, settings in grpo.items()} | {
        "diffusion_nft": (DiffusionNFTTrainer, {}),
        # Ablation: 3 noise levels per sample instead of ⌊0.99·N⌋, to show what dominates NFT's work.
        "diffusion_nft_3_levels": (DiffusionNFTTrainer, {"timestep_fraction": 3 / steps}),
        # Several optimizer updates per round on the same items (the old policy moved after each): same work.
        "diffusion_nft_5_updates": (DiffusionNFTTrainer, {"updates_per_round": 5}),
        "diffusion_nft_3_levels_3_updates": (
            DiffusionNFTTrainer,
            {"timestep_fraction": 3 / steps, "updates_per_round": 3},
        ),
        # DiffusionART (the config's defaults: ODE rollouts, ⌊0.99·N⌋ recorded states per sample, two update windows
        # per round); ART-Flash: only the 2 highest-noise states of each rollout.
        "diffusion_art": (DiffusionNFTTrainer, {"loss_type": "art", "updates_per_round": 2}),
        "art_flash": (DiffusionNFTTrainer, art_flash),
        # Ablation: a target 4× further along the guidance (η is this project's reading; the paper's is not public).
        "art_flash_step_4": (DiffusionNFTTrainer, art_flash | {"art_step_size": 4.0}),
        # Reward gradients (brightness is differentiable): SRPO's Direct-Align (denoise + inversion items per
        # sample) and DRaFT-1; the semantic-relative preference off (brightness ignores the prompt), grad clip 1.
        "direct_align": (DirectRewardTrainer, {"srp": False, "max_grad_norm": 1.0, "weight_decay": 0.0}),
        "draft_1": (DirectRewardTrainer, {"method": "draft", "srp": False, "max_grad_norm": 1.0, "weight_decay": 0.0}),
    }


class WorkMeter:
    """Counts denoiser rows through a forward pre-hook: 1 per row without gradient, 3 with (forward + backward)."""

    def __init__(self, module: torch.nn.Module):
        self.work, self.enabled = 0, True
        self._handle = module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        if self.enabled:
            rows = (args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))).shape[0]
            self.work += rows * (3 if torch.is_grad_enabled() else 1)

    def remove(self) -> None:
        self._handle.remove()


class Evaluator(TrainerCallback):
    """After every ``every`` rounds (one optimizer update each): the deterministic-sampler reward on fixed prompts and
    noises, with the work and the training wall time (evaluation excluded) so far."""

    def __init__(self, trainer: RolloutTrainer, meter: WorkMeter, every: int, seeds: int):
        self.trainer, self.meter, self.every = trainer, meter, every
        self.prompts = [p for p in PROMPTS for _ in range(seeds)]
        self.points: list[tuple[int, float, float, float]] = []  # (work, wall_s, reward, TFLOPs)
        self.evaluating_s, self.start, self.tflops = 0.0, time.perf_counter(), 0.0

    def score(self) -> float:
        begin = time.perf_counter()
        trainer, self.meter.enabled = self.trainer, False
        self.tflops += trainer.flops.take() / 1e12  # (on_step_end took the updates so far)
        generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(self.prompts))]
        images = trainer.sample(
            self.prompts, generators, model=trainer.model, plan=RolloutPlan.deterministic(trainer.policy.num_steps)
        )["images"]
        reward = float(torch.tensor(trainer.reward_funcs[0](self.prompts, images)).mean())
        trainer.flops.take()  # the evaluation's own calls: not training work
        wall = begin - self.start - self.evaluating_s
        self.points.append((self.meter.work, wall, reward, self.tflops))
        self.meter.enabled = True
        self.evaluating_s += time.perf_counter() - begin
        return reward

    def on_step_end(self, args, state, control, **kwargs):
        # Every update's FLOPs, before the trainer's log takes them (an evaluation step alone would miss the others,
        # and for methods with several updates per round, the rollouts).
        self.tflops += self.trainer.flops.take() / 1e12
        if state.global_step % self.every == 0:
            self.score()


def run_method(
    model: str, trainer_class: type[RolloutTrainer], settings: dict, options, workdir: str
) -> list[tuple[int, float, float]]:
    tiny = is_tiny(options.model)
    config = {
        "output_dir": os.path.join(workdir, "out"),
        "use_cpu": not torch.cuda.is_available(),
        "bf16": options.bf16,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": options.seed,
        "num_generations": options.generations,
        "generation_batch_size": options.batch,
        "num_inference_steps": options.steps,
        "height": resolution(options),
        "width": resolution(options),
        "num_frames": num_frames(options),
        "guidance_scale": 3.5,
        "max_sequence_length": 32 if tiny else 512,
        "learning_rate": options.learning_rate,
        "max_steps": options.rounds,
    } | settings
    updates = config.pop("updates_per_round", 1)
    config["max_steps"] = options.rounds * updates  # the same rounds (rollouts) for every method
    config_class = trainer_class.config_class
    # With one item per micro-batch, a round's micro-batches are its training items (transitions, re-noised samples).
    # (rollout_backprop refuses that probe's many updates per round; it does not change the count.)
    probe = {key: value for key, value in config.items() if key != "rollout_backprop"}
    items = config_class(**probe, gradient_accumulation_steps=1, per_device_train_batch_size=1).steps_per_generation
    # One optimizer update per round (the loss a mean over the round's items, whatever their number), or `updates`.
    train_batch = max(d for d in range(1, options.train_batch + 1) if items % d == 0 and (items // d) % updates == 0)
    config |= {
        "per_device_train_batch_size": train_batch,
        "gradient_accumulation_steps": items // train_batch // updates,
    }
    trainer = trainer_class(
        model,
        "brightness",
        args=config_class(**config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=lora_config(options.lora_rank),
    )
    meter = WorkMeter(trainer.policy.denoiser)
    evaluator = Evaluator(trainer, meter, options.eval_every, options.eval_seeds)
    trainer.add_callback(evaluator)
    evaluator.score()  # the initial policy: the same for every method
    evaluator.start += evaluator.points[0][1]  # the wall clock starts after it
    evaluator.points[0] = (0, 0.0, evaluator.points[0][2], 0.0)
    trainer.train()
    meter.remove()
    release(trainer)
    return evaluator.points


def reach(points: list[tuple[int, float, float, float]], target: float) -> tuple[float | None, ...]:
    """Work, wall time and TFLOPs at which the reward gain first reaches ``target``, interpolated between
    evaluations."""
    base = points[0][2]
    for (w0, t0, r0, f0), (w1, t1, r1, f1) in zip(points, points[1:]):
        if r1 - base >= target:
            f = 1.0 if r1 == r0 else min(1.0, max(0.0, (base + target - r0) / (r1 - r0)))
            return w0 + f * (w1 - w0), t0 + f * (t1 - t0), f0 + f * (f1 - f0)
    return None, None, None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default_model="tiny-flux")
    parser.add_argument("--steps", type=int, default=16, help="denoising steps N (DanceGRPO's 16)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per round")
    parser.add_argument("--train-batch", type=int, default=16, help="at most this many transitions per micro-batch")
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-seeds", type=int, default=2, help="noises per evaluation prompt")
    parser.add_argument("--target", type=float, default=0.5, help="fraction of DanceGRPO's best gain to reach")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every method per seed")
    parser.add_argument("--methods", nargs="+", default=None, help="default: all (DanceGRPO always runs)")
    options = parser.parse_args(argv)
    table = methods(options.steps, options.rounds)
    names = ["dancegrpo", *[m for m in (options.methods or table) if m != "dancegrpo"]]
    unknown = sorted(set(names) - set(table))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {sorted(table)}")

    per_seed = []  # per seed: {name: figures}
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(options.model, workdir, layers=options.layers)
        for seed in options.seeds:
            options.seed = seed
            curves = {}
            for name in names:
                curves[name] = run_method(model, *table[name], options, workdir)
                points = [(w, round(t, 1), round(r, 4), round(f, 6)) for w, t, r, f in curves[name]]
                print(f"seed {seed} {name}: (work, wall_s, reward, TFLOPs) {points}")
            per_seed.append(_figures(curves, options))

    results = {}
    for name in names:
        runs = [figures[name] for figures in per_seed]
        results[name] = {
            key: _median([run[key] for run in runs], key.endswith("ratio")) for key in runs[0] if key != "gains"
        }
        results[name] |= {f"{key}_per_seed": [run[key] for run in runs] for key in ("work_ratio", "wall_ratio")}
        results[name]["gains_per_seed"] = [run["gains"] for run in runs]
        ratio = results[name]
        print(
            f"{name:>26}: work ratio {_show(ratio['work_ratio'])} (seeds {_show(ratio['work_ratio_per_seed'])}), wall "
            f"ratio {_show(ratio['wall_ratio'])}, TFLOPs ratio {_show(ratio['tflops_ratio'])}, work/round "
            f"{ratio['work_per_round']:.0f} ({ratio['tflops_per_round']:.3g} TFLOPs), best gain "
            f"{ratio['best_gain']:+.4f}"
        )
    others = {n: r["work_ratio"] for n, r in results.items() if n != "dancegrpo" and r["work_ratio"]}
    best = max(others, key=others.get) if others else None
    return emit(
        {
            "methods": results,
            "target_gains": [figures["dancegrpo"]["target_gain"] for figures in per_seed],
            "best_method": best,
            "best_work_ratio": others.get(best),
            "model": options.model,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "options": vars(options),
        }
    )


def _figures(curves: dict[str, list], options) -> dict[str, dict]:
    """One seed's figures per method: work and wall time to the target gain, their ratios to DanceGRPO's."""

    def gain(points):
        return max(point[2] for point in points) - points[0][2]

    target = options.target * gain(curves["dancegrpo"])
    reference = reach(curves["dancegrpo"], target)
    figures = {}
    for name, points in curves.items():
        work, wall, tflops = reach(points, target)
        figures[name] = {
            "work": work,
            "wall_s": wall,
            "tflops": tflops,  # the denoiser's closed-form TFLOPs to the target (trl_dance.flops)
            "work_ratio": reference[0] / work if work else None,
            "wall_ratio": reference[1] / wall if wall else None,
            "tflops_ratio": reference[2] / tflops if tflops else None,
            "final_gain": points[-1][2] - points[0][2],
            "best_gain": gain(points),
            "work_per_round": points[-1][0] / options.rounds,
            "wall_s_per_round": points[-1][1] / options.rounds,
            "target_gain": target,
            "tflops_per_round": points[-1][3] / options.rounds,
            "gains": [round(point[2] - points[0][2], 5) for point in points],
        }
    return figures


def _median(values: list, ratio: bool):
    """The median over seeds; a seed in which the method never reached the target counts as ratio 0 (infinite work and
    time), and an infinite median is None."""
    missing = 0.0 if ratio else math.inf
    value = statistics.median([missing if v is None else v for v in values])
    return None if value == math.inf else value


def _show(value) -> str:
    if isinstance(value, list):
        return "/".join(_show(v) for v in value)
    return "n/a" if value is None else f"{value:.2f}×"


if __name__ == "__main__":
    main()
