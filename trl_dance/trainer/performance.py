"""How fast a run is: the denoiser's FLOPs, throughput, MFU, where the wall time goes, peak memory.

Logged at every log step as ``perf/*`` (see :class:`PerformanceArguments`). Phase times come from the host clock
with CUDA events at the phase boundaries, read at log time: no phase adds a host-device synchronisation.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

PEAK_TFLOPS: dict[str, float] = {
    # Dense bf16 tensor-core peaks (no sparsity), TFLOP/s per device, by a substring of torch's device name; the
    # first match wins, so the more specific names come first.
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
}


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of the accelerator named ``device_name`` (``torch.cuda.get_device_name()``), or None
    for one not in :data:`PEAK_TFLOPS`."""
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_name), None)


@dataclass
class PerformanceArguments:
    r"""
    Performance accounting, on every trainer's config.

    Parameters:
        peak_tflops (`float` or `None`, defaults to `None`): the accelerator's peak TFLOP/s for `perf/mfu`; by default
            looked up by device name in `trl_dance.trainer.performance.PEAK_TFLOPS` (dense bf16: H100/H200/B200/
            A100/L40S/MI300X, ...). No MFU is logged without one (CPUs, unknown devices).

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

    def __init__(self, device: torch.device, peak: float | None):
        self.device = device
        if peak is None and device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(device))
        self.peak = peak
        self._cuda = device.type == "cuda"
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
        try:
            yield
        finally:
            self._spans[self._open.pop()][2] = self._mark()

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
