"""PyTorch's SDPA kernels at the attention shapes of the real models: error against a float32 reference and
forward + backward time, per kernel (flash, efficient, cuDNN), in the layout diffusers passes them.

    python benchmarks/attention_kernels.py            # every kernel, each in its own process; JSON lines, a table

Each kernel runs in a fresh process: an illegal memory access (seen once with cuDNN's backward on FLUX.1 on an
H200) poisons the CUDA context of the process that made it, and the cases printed before it say where it happened.
Layouts: ``permuted`` is what diffusers' native dispatcher hands SDPA (tensors (B, L, H, D) permuted to
(B, H, L, D), not contiguous), ``contiguous`` the same values copied to (B, H, L, D) storage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

# (name, batch, heads, query/key tokens, head dim): FLUX.1-dev's joint attention at 512² (the shape of the fault)
# and 1024²; Wan 2.1 14B's self-attention at 480×832×33 (14,040 tokens: not a multiple of 64); the SD3.5-medium
# head dimension 64 that ran with cuDNN.
SHAPES = [
    ("flux-512", 2, 24, 1536, 128),
    ("flux-1024", 2, 24, 4608, 128),
    ("wan14b-33f", 1, 40, 14040, 128),
    ("sd35-1024", 2, 24, 4429, 64),
]
KERNELS = {
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
}
REFERENCE_MAX_TOKENS = 5000  # a float32 math reference beyond this needs tens of GB for the score matrix


def _inputs(batch, heads, tokens, dim, layout, seed):
    generator = torch.Generator("cuda").manual_seed(seed)
    tensors = []
    for _ in range(4):  # q, k, v, grad of the output
        x = torch.randn(batch, tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        x = x.permute(0, 2, 1, 3)
        tensors.append(x.contiguous() if layout == "contiguous" else x)
    return tensors


def _run(kernel, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel([kernel]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, grad):
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    out = scores.softmax(-1) @ v
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def _relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def one_kernel(name: str) -> None:
    """Every shape and layout with kernel ``name``: a JSON line each, flushed before the next case starts."""
    kernel = KERNELS[name]
    for shape, batch, heads, tokens, dim in SHAPES:
        for layout in ("permuted", "contiguous"):
            case = {"kernel": name, "shape": shape, "layout": layout, "tokens": tokens, "head_dim": dim}
            print(json.dumps({**case, "started": True}), flush=True)
            try:
                q, k, v, grad = _inputs(batch, heads, tokens, dim, layout, seed=0)
                got = _run(kernel, q, k, v, grad)
                torch.cuda.synchronize()
                if tokens <= REFERENCE_MAX_TOKENS:
                    want = _reference(q, k, v, grad)
                    case["errors"] = [_relative(a, b) for a, b in zip(got, want)]  # out, dq, dk, dv
                    case["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
                    del want
                for _ in range(2):
                    _run(kernel, q, k, v, grad)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                repeats = 5
                start.record()
                for _ in range(repeats):
                    _run(kernel, q, k, v, grad)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / repeats
                flops = 4 * batch * heads * tokens * tokens * dim * 3.5  # forward + backward (2.5 forwards)
                case.update(ms=ms, tflops_per_s=flops / ms / 1e9)
            except RuntimeError as error:  # a kernel that refuses the case (not an illegal access: that aborts)
                case["error"] = str(error).splitlines()[0][:300]
                torch.cuda.synchronize()
            print(json.dumps(case), flush=True)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default=None, help="(internal) run one kernel here")
    parser.add_argument("--timeout", type=float, default=120.0)
    options = parser.parse_args(argv)
    if options.kernel:
        one_kernel(options.kernel)
        return []
    versions = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda}
    records = []
    for name in KERNELS:
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--kernel", name],
                capture_output=True, text=True, timeout=options.timeout,
            )  # fmt: skip
            lines, returncode, stderr = done.stdout.splitlines(), done.returncode, done.stderr
        except subprocess.TimeoutExpired as timed_out:
            out = timed_out.stdout or b""
            lines = (out.decode() if isinstance(out, bytes) else out).splitlines()
            returncode, stderr = "timeout", ""
        cases = [json.loads(line) for line in lines if line.startswith("{")]
        finished = [c for c in cases if not c.get("started")]
        if len(cases) > 2 * len(finished):  # a case started and never finished: the process died in it
            crashed = cases[-1]
            errors = [line for line in stderr.splitlines() if "Error" in line or "error" in line]
            finished.append({**crashed, "started": None, "crashed": f"exit {returncode}: {' | '.join(errors[-2:])}"})
        for case in finished:
            case.pop("started", None)
            case.update(versions)
            records.append(case)
            print(json.dumps(case), flush=True)
        print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print("| kernel | shape | layout | ms fwd+bwd | TFLOP/s | rel. error out / dq / dk / dv | |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in records:
        errors = " / ".join(f"{e:.1e}" for e in c.get("errors", [])) or "–"
        note = c.get("crashed") or c.get("error") or ("" if c.get("finite", True) else "NaN/inf")
        ms = f"{c['ms']:.2f}" if "ms" in c else "–"
        rate = f"{c['tflops_per_s']:.0f}" if "tflops_per_s" in c else "–"
        print(f"| {c['kernel']} | {c['shape']} | {c['layout']} | {ms} | {rate} | {errors} | {note[:100]} |")
    return records


if __name__ == "__main__":
    main()
