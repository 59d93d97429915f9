#!/usr/bin/env bash
# The whole GPU procedure of bench/README.md's GPU section, in one command on a lent GPU machine (no registry there).
#
#   bash bench/benchmarks/gpu_run.sh [PHASES...]        # default: env mfu trainer fp32 aligned compile
#
# Needs, in the repository root: .whl/ (deepspeed 0.19.8 and what it and webdataset need that the machine lacks, see
# bench/README.md) and .gpudata/wikitext-2 (memlm prepare --corpus wikitext --tokenizer word). Writes under $OUT
# (default bench/results/gpu): gpu_run.log, mfu_cuda.json, mfu_cuda_fp32.json, mfu_cuda_aligned.json,
# mfu_cuda_compile_{txl,lamemo}.json,
# profile_bf16_cuda.txt, trainer_cuda.json, runs.tar.gz (metrics.jsonl, configs and logs of every trainer run).
# BUDGET (seconds, default 530): no phase or trainer run starts after it, so the whole ends inside a 600 s call.
# CPU smoke run of the flow (no wheels needed where the venv has them):
#   OUT=/tmp/gout MFU_ARGS="--device cpu --n-layer 2 --lanes 2 --steps 2 --warmup 1" TRAINER_ARGS="--size tiny" \
#     TRAINER_PHASES="resume timing" PATH=.venv/bin:$PATH bash bench/benchmarks/gpu_run.sh mfu trainer
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
START=$(date +%s)
BUDGET=${BUDGET:-530}
DEADLINE=$((START + BUDGET))
RUNS=/tmp/gpu_runs
mkdir -p "$RUNS"
PHASES=${*:-env mfu trainer fp32 aligned compile}
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
export TORCH_EXTENSIONS_DIR=/tmp/ds_ext TORCH_CUDA_ARCH_LIST=9.0
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
left() { echo $((DEADLINE - $(date +%s))); }
stamp() { echo "=== [$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }

if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD

for phase in $PHASES; do
  case $phase in
  env)
    stamp env
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
    nvcc --version | tail -2
    [ -f COMMIT ] && echo "code: $(tail -1 COMMIT) (a git archive of it)" || { git log -1 --format='commit %H %s' 2>/dev/null; git status --short 2>/dev/null | head -20; }
    python3 - <<'EOF'
import torch, deepspeed, webdataset, pydantic
from deepspeed.accelerator import get_accelerator
p = torch.cuda.get_device_properties(0)
print("python3 torch", torch.__version__, "cuda", torch.version.cuda, "device", p.name, "SMs", p.multi_processor_count,
      "mem GiB", round(p.total_memory / 2**30, 1), "bf16", torch.cuda.is_bf16_supported())
print("deepspeed", deepspeed.__version__, "accelerator", get_accelerator()._name, "pydantic", pydantic.VERSION,
      "webdataset", webdataset.__version__)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): a @ b
e.record(); torch.cuda.synchronize()
print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s (random data)")
EOF
    ;;
  mfu)
    stamp "mfu bf16 (+ profile of txl and lamemo)"
    python3 bench/benchmarks/bench_mfu.py --out "$OUT/mfu_cuda.json" --profile "$OUT/profile_bf16_cuda.txt" \
      --profile-archs txl lamemo --profile-steps 5 ${MFU_ARGS:-}
    ;;
  trainer)
    stamp "fused Adam JIT build in the background; trainer resume + timing, then fused"
    rm -f "$RUNS/fused_ready"
    ( t0=$(date +%s)
      python3 -c "
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('FusedAdamBuilder').load(verbose=True)
" > "$RUNS/fused_build.log" 2>&1
      rc=$?; echo "rc $rc, $(( $(date +%s) - t0 )) s" > "$RUNS/fused_ready" ) &
    python3 bench/benchmarks/bench_gpu_trainer.py --data .gpudata/wikitext-2 --runs "$RUNS" --out "$OUT/${TRAINER_JSON:-trainer_cuda.json}" \
      --phases ${TRAINER_PHASES:-resume timing fused} ${TRAINER_ARGS:-} --fused-ready "$RUNS/fused_ready" --deadline "$((DEADLINE - 30))"
    echo "fused build: $(cat "$RUNS/fused_ready" 2>/dev/null)"; tail -5 "$RUNS/fused_build.log" 2>/dev/null
    ;;
  fp32)
    if [ "$(left)" -lt 70 ]; then stamp "skip fp32: $(left) s left"; continue; fi
    stamp "mfu fp32 (tf32 matmuls)"
    timeout $(( $(left) - 10 )) python3 bench/benchmarks/bench_mfu.py --precision fp32 --out "$OUT/mfu_cuda_fp32.json" ${MFU_ARGS:-}
    ;;
  compile)
    for arch in txl lamemo; do
      if [ "$(left)" -lt 100 ]; then stamp "skip compile $arch: $(left) s left"; continue; fi
      stamp "mfu bf16, torch.compile, $arch"
      timeout $(( $(left) - 5 )) python3 bench/benchmarks/bench_mfu.py --compile --archs $arch --out "$OUT/mfu_cuda_compile_$arch.json" ${MFU_ARGS:-}
    done
    ;;
  aligned)
    if [ "$(left)" -lt 60 ]; then stamp "skip aligned: $(left) s left"; continue; fi
    stamp "mfu bf16 at a tensor-core-aligned shape (d_model 512, 8 x 64, d_inner 2048), txl and lamemo"
    timeout $(( $(left) - 5 )) python3 bench/benchmarks/bench_mfu.py --d-model 512 --n-head 8 --d-head 64 --d-inner 2048 \
      --archs txl lamemo --out "$OUT/mfu_cuda_aligned.json" ${MFU_ARGS:-}
    ;;
  *) echo "unknown phase $phase" ;;
  esac
done
stamp done
tar czf "$OUT/runs.tar.gz" --exclude=checkpoints -C /tmp gpu_runs 2>/dev/null
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("mfu_cuda.json", "mfu_cuda_fp32.json", "mfu_cuda_aligned.json", "mfu_cuda_compile_txl.json",
             "mfu_cuda_compile_lamemo.json"):
    p = out / name
    if p.exists():
        d = json.loads(p.read_text())
        print(f"{name} ({d['precision']}, {d['device'].get('name')}):")
        for r in d["rows"]:
            print(f"  {r['arch']:>11} {1e3 * r['step_s_median']:7.1f} ms {r['tokens_per_s']:9,.0f} tok/s "
                  f"{r['achieved_tflops']:6.1f} TFLOP/s MFU {100 * (r['mfu'] or 0):5.1f}% peak {r.get('peak_mem_gib', 0):5.1f} GiB")
for p in sorted(out.glob("trainer_cuda*.json")):
    d = json.loads(p.read_text())
    print(p.name)
    for phase, data in d["phases"].items():
        if not isinstance(data, dict):
            print(phase, data); continue
        for r in data["runs"]:
            if phase == "resume":
                print(f"  {r['name']}: rc {r['rc']} before-stop {r['before_stop_vs_full'].get('bit_identical')} "
                      f"{r['before_stop_vs_full'].get('max_abs_diff')} after-resume {r['after_resume_vs_full'].get('bit_identical')} "
                      f"{r['after_resume_vs_full'].get('max_abs_diff')} first-diff {r['after_resume_vs_full'].get('first_differing_step')}")
            else:
                print(f"  {r['name']:>22}: rc {r['rc']} {r.get('tokens_per_s_median', 0):9,.0f} tok/s loss "
                      f"{r.get('final_loss', float('nan')):.4f} peak {r.get('peak_mem_mb', 0):7,.0f} MiB wall {r['wall_s']:.0f} s")
EOF
