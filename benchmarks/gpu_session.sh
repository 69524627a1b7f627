#!/usr/bin/env bash
# Everything a lent GPU should run first, in one command under 10 minutes (device time comes in windows of about 15):
#
#   1. software and device versions (versions.txt);
#   2. PyTorch's SDPA kernels (flash, efficient, cuDNN) at the real models' attention shapes: error against float32
#      and forward + backward time, each kernel in its own process (attention.jsonl, benchmarks/attention_kernels.py);
#   3. the GPU matrix rows of issue 55, the baseline first so that every ratio has its baseline from the same call,
#      each with a profiler breakdown of its timed round by phase (gemm / attention / norm / elementwise / memcpy /
#      idle, top kernels) and phase MFU (gpu.jsonl, benchmarks/grpo_iteration.py --profile).
#
# Prepare here (no GPU needed): bash benchmarks/device_wheels.sh   (wheels the GPU image lacks, into .whl/)
# Then, through the device tool, carrying .whl:
#   bash benchmarks/gpu_session.sh [BUDGET_S] [ROW ...]
# Results go to $OUT (the device tool's folder) or ./gpu_session/; the table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
budget="${1:-480}"
shift || true
rows=("$@")
if [ ${#rows[@]} -eq 0 ]; then
    rows=(
        grpo-flux-1024-lora64-gc                          # the baseline (eager, flash attention), rerun here
        grpo-flux-1024-lora64-gc-compile-cudnn            # the defaults since 2026-11-27: compiled, cuDNN attention
                                                          # (whole compiled training blocks since 2026-11-29)
        grpo-flux-1024-lora64-gc-compile-cudnn-backprop   # and recompute-free GRPO (rollout_backprop)
        grpo-wan14b-33f-lora64-gc-compile-cudnn           # video, the same defaults
        grpo-hunyuan15-33f-lora64-gc-compile              # masked text attention: flash/efficient, compiled
    )
fi
out="${OUT:-gpu_session}"
mkdir -p "$out"
start=$(date +%s)
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "import torch, diffusers, transformers, trl, peft, accelerate, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(),
      'triton', triton.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__,
      'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
} | tee "$out/versions.txt"
echo "== SDPA kernels at the models' shapes"
timeout 150 python3 benchmarks/attention_kernels.py --timeout 45 > "$out/attention.jsonl" 2> "$out/attention.err"
grep -v '^{' "$out/attention.jsonl"; tail -3 "$out/attention.err"
left=$((budget - ($(date +%s) - start)))
echo "== matrix rows, ${left} s left: ${rows[*]}"
python3 benchmarks/matrix.py gpu --only "${rows[@]}" --budget "$left" --timeout 300 --output "$out/gpu.jsonl" \
    --markdown "$out/gpu.md" --no-floor --profile /tmp 2>&1 | grep -v '^{' | tee "$out/matrix.log"
python3 - "$out/gpu.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "failed" in r:
        print(r["name"], "FAILED", r["failed"][:200], (r.get("stderr_tail") or "")[-600:])
        continue
    def pct(key):
        return "–" if r.get(key) is None else f"{100 * r[key]:.1f} %"
    print(f"{r['name']}: rollout {1e3 * r['rollout_s_per_sample']:.0f} ms/sample, train "
          f"{1e3 * r['train_s_per_item']:.0f} ms/transition, peak {r['peak_mem_mb'] / 1024:.1f} GB, MFU {pct('mfu')} "
          f"(rollout {pct('mfu_rollout')}, train {pct('mfu_train')})")
    if r.get("compiled"):  # whole blocks: no graph break, nothing compiled once the warm-up round is over
        print("   compiled: " + ", ".join(f"{n} {v}" for n, v in r["compiled"].items()))
    for phase, k in (r.get("kernels") or {}).items():
        shares = " ".join(f"{n} {100 * v:.0f}" for n, v in k["shares"].items())
        print(f"   {phase}: busy {100 * k['busy']:.0f} % ({shares}); top: "
              + "; ".join(f"{n[:60]} {ms:.0f} ms" for n, ms, _ in k["top_kernels"][:4]))
EOF
echo "== $(($(date +%s) - start)) s"
