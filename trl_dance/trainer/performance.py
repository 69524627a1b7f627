"""How fast a run is: the denoiser's FLOPs, throughput, MFU, where the wall time goes, peak memory.

Logged at every log step as ``perf/*`` (see :class:`PerformanceArguments`). Phase times come from the host clock
with CUDA events at the phase boundaries, read at log time: no phase adds a host-device synchronisation.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


def peak_tflops(device_name: str, dtype: str = "bfloat16") -> float | None:
    """Dense peak TFLOP/s of the accelerator named ``device_name`` (``torch.cuda.get_device_name()``) for matrix
    multiplications in ``dtype`` ("bfloat16", "float16"), or None where TRL's table has no figure (CPUs, float32,
    unknown devices). TRL's own lookup (``trl.trainer.utils.get_peak_flops``: whole-word names, per dtype), which its
    MFU metrics use, so that ``perf/mfu`` and TRL's ``mfu`` agree on one device."""
    from trl.trainer.utils import get_peak_flops

    peak = get_peak_flops(device_name, dtype)
    return None if peak is None else peak / 1e12


def mixed_precision_dtype(args) -> str:
    """The dtype name of a config's matrix multiplications ("bfloat16", "float16" or "float32"), as TRL names it."""
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"


@dataclass
class PerformanceArguments:
    r"""
    Performance accounting, on every trainer's config.

    Parameters:
        peak_tflops (`float` or `None`, defaults to `None`): the accelerator's peak TFLOP/s for `perf/mfu`; by default
            TRL's dense peak for the device's name and the run's precision (`trl.trainer.utils.get_peak_flops`:
            H100/H200 SXM, PCIe and NVL, B200, A100, L40S, L4, MI300X, ... in bf16 or fp16). No MFU is logged
            without one (CPUs, float32, unknown devices).

    Logged metrics: `perf/denoiser_tflops` (the denoiser's TFLOPs over all processes since the previous log: forwards of
    rollouts, old/reference and training calls, their backwards and activation-checkpointing recomputation, counted in
    closed form by `trl_dance.flops`), `perf/tflops_per_s` (per process), `perf/mfu`, `perf/mfu/rollout` and
    `perf/mfu/training` (each phase's denoiser FLOPs over that phase's time), `perf/samples_per_s` (samples
    trained, all processes), `perf/time/{rollout,reward,training,other}` (fractions of the wall time), `perf/step_s`
    (wall seconds per optimizer step), `perf/peak_memory_gb` (largest peak allocated accelerator memory of a process).
    """

    peak_tflops: float | None = field(
        default=None, metadata={"help": "Peak TFLOP/s of one accelerator for perf/mfu (default: looked up by name)."}
    )


class PerformanceLog:
    """Counts a trainer's work and wall time between log steps (see the module docstring)."""

    PHASES = ("rollout", "reward", "training")

    def __init__(self, device: torch.device, peak: float | None, dtype: str = "bfloat16"):
        self.device = device
        if peak is None and device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(device), dtype)
        self.peak = peak
        self._cuda = device.type == "cuda"
        self.changed_at = time.monotonic()  # when a phase last began or ended (the hang report's progress)
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self._start, self._samples = now, 0.0
        self._spans: list[list] = []  # [phase, start mark, end mark, index of the enclosing span or None]
        self._open: list[int] = []

    def add_samples(self, count: float) -> None:
        """``count`` samples trained by this process (a context-parallel group's ranks each add 1/C of theirs)."""
        self._samples += count

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name``; a phase inside another is taken out of the outer one's time."""
        self._spans.append([name, self._mark(), None, self._open[-1] if self._open else None])
        self._open.append(len(self._spans) - 1)
        self.changed_at = time.monotonic()
        try:
            yield
        finally:
            self._spans[self._open.pop()][2] = self._mark()
            self.changed_at = time.monotonic()

    def current_phase(self) -> str:
        """The innermost open phase (``"other"`` outside every phase): the phase a denoiser call's FLOPs belong to."""
        return self._spans[self._open[-1]][0] if self._open else "other"

    def _mark(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self._cuda else end - start

    def metrics(self, flops: dict[str, float], steps: int, accelerator) -> dict[str, float]:
        """The ``perf/*`` metrics since the previous call, given this process's denoiser ``flops`` by phase and the
        optimizer ``steps`` taken (two collectives)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        wall = max(now - self._start, 1e-9)
        seconds = dict.fromkeys(self.PHASES, 0.0)
        for name, start, end, parent in self._spans:
            if end is None:  # still open (a log inside a phase): counted at the next log
                continue
            duration = self._seconds(start, end)
            seconds[name] += duration
            if parent is not None:
                seconds[self._spans[parent][0]] -= duration
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self._cuda else 0.0
        by_phase = [flops.get(name, 0.0) for name in self.PHASES]
        local = torch.tensor(
            [sum(flops.values()), self._samples, *by_phase, memory], dtype=torch.float64, device=self.device
        )
        total = accelerator.reduce(local.clone(), "sum").tolist()
        peak_memory = accelerator.reduce(local[-1:].clone(), "max").item()
        processes = accelerator.num_processes
        tflops = total[0] / 1e12
        logs = {
            "perf/denoiser_tflops": tflops,
            "perf/tflops_per_s": tflops / processes / wall,
            "perf/samples_per_s": total[1] / wall,
            "perf/step_s": wall / max(steps, 1),
        }
        if self.peak:
            logs["perf/mfu"] = logs["perf/tflops_per_s"] / self.peak
            # Per phase: its FLOPs (per process) over its own time; reward and other run no denoiser.
            for name, phase_flops in zip(self.PHASES, total[2:-1]):
                if name != "reward" and seconds[name] > 0:
                    logs[f"perf/mfu/{name}"] = phase_flops / processes / seconds[name] / 1e12 / self.peak
        for name in self.PHASES:
            logs[f"perf/time/{name}"] = min(max(seconds[name], 0.0) / wall, 1.0)
        logs["perf/time/other"] = max(0.0, 1.0 - sum(logs[f"perf/time/{name}"] for name in self.PHASES))
        if self._cuda:
            logs["perf/peak_memory_gb"] = peak_memory
        open_spans = [self._spans[i] for i in self._open]
        self.reset(now)
        for span in open_spans:  # a phase spanning the log restarts its clock here
            span[1], span[3] = self._mark(), None
            self._spans.append(span)
            self._open.append(len(self._spans) - 1)
        return logs
