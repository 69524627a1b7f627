"""Where a GPU's time goes: torch.profiler's kernel timeline of one training round, by phase and kernel class.

:class:`RoundProfiler` records one round (rollout and training, marked by :func:`phase` ranges); :func:`breakdown`
reads the exported Chrome trace and returns, per phase, the wall time, the share of it each kernel class kept the GPU
busy (``gemm``, ``attention``, ``norm``, ``elementwise``, ``memcpy``), the idle share (no kernel or copy running:
host-bound gaps, synchronisations, launch latency) and the ten kernels that took longest. Shares are of the phase's
wall time and add up to about 1 (kernels overlapping on several streams count in each of their classes).

    python benchmarks/kernel_profile.py trace.json      # the breakdown of a saved trace, as JSON
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections import defaultdict

import torch

PHASE_PREFIX = "trl_dance.phase."

# Kernel classes by name, first match wins (cuBLAS/cuBLASLt's Hopper GEMMs are "nvjet_*", "sm90_xmma_*", CUTLASS's
# "cutlass*"; attention: flash/efficient/cuDNN fused kernels; Triton kernels that inductor fused into a GEMM
# template are "triton_tem_*").
CLASSES = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|mha_|cudnn_generated_fort_native_sdpa", re.I)),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|matmul|triton_tem_|splitk|gemv|cublas", re.I)),
    ("norm", re.compile(r"norm|rms|welford|softmax", re.I)),
)


def kernel_class(name: str, category: str) -> str:
    """The class of one trace event (``category`` is the trace's ``cat``: kernel, gpu_memcpy, gpu_memset)."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "elementwise"


@contextlib.contextmanager
def phase(name: str):
    """Mark a phase (``rollout``, ``train``) on the profiler's CPU timeline (a no-op when nothing records)."""
    with torch.profiler.record_function(PHASE_PREFIX + name):
        yield


class RoundProfiler:
    """torch.profiler over one round: ``start()`` before it, ``stop(path)`` after it (outside any timed window: the
    profiler's post-processing takes seconds at full size) writes the trace to ``path``."""

    def __init__(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)

    def start(self) -> None:
        self.profile.start()

    def stop(self, path: str) -> dict:
        self.profile.stop()
        self.profile.export_chrome_trace(path)
        return breakdown(path)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def breakdown(trace_path: str, top: int = 10) -> dict:
    """Per phase marked with :func:`phase` (all of the trace if none is): ``wall_ms``, ``busy`` (share of the wall
    time some kernel or copy ran), ``idle`` = 1 − busy, ``shares`` by class, ``top_kernels`` [(name, ms, calls)]."""
    with open(trace_path) as handle:
        events = json.load(handle)["traceEvents"]
    device_events = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    windows = {
        e["name"][len(PHASE_PREFIX) :]: (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(PHASE_PREFIX)
    }
    if not windows and device_events:
        windows = {"all": (min(e["ts"] for e in device_events), max(e["ts"] + e["dur"] for e in device_events))}
    result = {}
    for name, (begin, end) in windows.items():
        # A phase's GPU work ends before its CPU range closes when the phase synchronises at its end (the benchmark
        # does); work launched at its end and still running counts up to the next phase's start.
        inside = [e for e in device_events if begin <= e["ts"] < end]
        wall = max(end - begin, 1e-9)
        by_class: dict[str, float] = defaultdict(float)
        by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for e in inside:
            by_class[kernel_class(e["name"], e["cat"])] += e["dur"]
            by_kernel[e["name"]][0] += e["dur"]
            by_kernel[e["name"]][1] += 1
        busy = _union([(e["ts"], min(e["ts"] + e["dur"], end)) for e in inside]) / wall
        kernels = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:top]
        result[name] = {
            "wall_ms": wall / 1e3,
            "busy": busy,
            "idle": 1.0 - busy,
            "shares": {
                label: by_class[label] / wall for label in ("gemm", "attention", "norm", "elementwise", "memcpy")
            },
            "top_kernels": [(kernel[:120], ms / 1e3, calls) for kernel, (ms, calls) in kernels],
        }
    return result


def summary_line(name: str, figures: dict) -> str:
    """One line per phase: wall, busy and class shares in %."""
    shares = " ".join(f"{label} {100 * share:.0f}" for label, share in figures["shares"].items())
    return f"  {name:8s} {figures['wall_ms']:9.0f} ms  busy {100 * figures['busy']:.0f} %  ({shares} %)"


if __name__ == "__main__":
    print(json.dumps(breakdown(sys.argv[1]), indent=1))
