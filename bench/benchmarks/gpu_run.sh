#!/usr/bin/env bash
# The whole GPU procedure of bench/README.md's GPU section, in one command on a lent GPU machine (no registry there).
#
#   bash bench/benchmarks/gpu_run.sh [PHASES...]        # default: env mfu trainer fp32 aligned compile
#   bash bench/benchmarks/gpu_run.sh env equal fast     # the fast path: GPU equality tests, then MFU per arch/shape/lanes
#   bash bench/benchmarks/gpu_run.sh env peers          # the peers on this GPU (their wheels in .whl)
#   bash bench/benchmarks/gpu_run.sh env equal profile  # equality tests, then the compiled step profiled (bench_gpu_profile.py)
#
# Needs, in the repository root: .whl/ (deepspeed 0.19.8 and what it and webdataset need that the machine lacks, see
# bench/README.md; phase equal also pytest, pluggy and iniconfig) and .gpudata/wikitext-2 (memlm prepare --corpus wikitext --tokenizer word). Writes under $OUT
# (default bench/results/gpu): gpu_run.log, mfu_cuda.json, mfu_cuda_fp32.json, mfu_cuda_aligned.json,
# mfu_cuda_compile_{txl,lamemo}.json, mfu_cuda_fast_{paper,aligned}_ARCH_LANES.json (phase fast; FAST_ARCHS,
# FAST_LANES choose), profile_bf16_cuda.txt, trainer_cuda.json, runs.tar.gz (metrics.jsonl, configs and logs of every trainer run).
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
import importlib
import torch
p = torch.cuda.get_device_properties(0)
print("python3 torch", torch.__version__, "cuda", torch.version.cuda, "device", p.name, "SMs", p.multi_processor_count,
      "mem GiB", round(p.total_memory / 2**30, 1), "bf16", torch.cuda.is_bf16_supported())
# Phases equal and fast need torch alone; mfu's trainer phase needs these (carried as wheels).
for name in ("deepspeed", "webdataset", "pydantic", "triton"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError:
        print(name, "not installed")
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
  equal)
    # FlexAttention against the einsum path (loss and every gradient, fp32 and bf16, every arch) and the chunked
    # softmax head under bf16: the GPU half of tests/models/test_attention_flex.py and test_adaptive.py (pytest
    # and its few dependencies travel in .whl).
    stamp "GPU equality tests: flex = eager, chunked head = full"
    # EQUAL_WORKERS=N runs them in N pytest-xdist workers (each compiles its own kernels; the GPU images have xdist).
    workers=""; [ -n "${EQUAL_WORKERS:-}" ] && workers="-n $EQUAL_WORKERS"
    # Then the Triton kernels compiled (every test of the file, bf16 included), in the models (gpu), the sync-free
    # head with its plans, and the trainer's step parts on the device (pinned, non_blocking, one read per step).
    timeout $(( $(left) < ${EQUAL_LIMIT:-600} ? $(left) - 5 : ${EQUAL_LIMIT:-600} )) python3 -m pytest -q \
      -p no:cacheprovider $workers tests/models/test_attention_flex.py tests/models/test_adaptive.py \
      tests/models/test_triton_in_models.py tests/trainer/loop/test_host_syncs.py -k "gpu or every_device" 2>&1 | tail -40
    timeout $(( $(left) < ${EQUAL_LIMIT:-600} ? $(left) - 5 : ${EQUAL_LIMIT:-600} )) python3 -m pytest -q \
      -p no:cacheprovider $workers tests/models/test_attention_triton.py tests/models/test_adaptive_nll.py \
      tests/models/test_head_plan.py tests/models/test_head_compile.py 2>&1 | tail -40
    ;;
  fast)
    # The fast path: FlexAttention, the chunked head, torch.compile (inductor), at the paper's 410 / 10 x 41 shape
    # and the aligned 512 / 8 x 64 one, at FAST_LANES lanes; each JSON row has the compile time (warmup_s), graph
    # breaks and recompiles after warm-up. One arch per command, so a slow compile costs one row, not the phase.
    # FAST_RUNS="SHAPE:ARCH:LANES ..." runs exactly those, in that order (most wanted first, as the budget may cut
    # the tail); by default every lanes x shape x arch of FAST_LANES, paper and aligned, FAST_ARCHS.
    runs=${FAST_RUNS:-}
    if [ -z "$runs" ]; then
      for lanes in ${FAST_LANES:-64 128}; do for shape in paper aligned; do
        for arch in ${FAST_ARCHS:-txl lamemo rmt transformer}; do runs="$runs $shape:$arch:$lanes"; done
      done; done
    fi
    for run in $runs; do
      IFS=: read -r shape arch lanes <<< "$run"
      if [ "$(left)" -lt 90 ]; then stamp "skip fast $shape $arch $lanes: $(left) s left"; continue; fi
      widths=""; [ "$shape" = aligned ] && widths="--d-model 512 --n-head 8 --d-head 64 --d-inner 2048"
      stamp "mfu bf16 fast path: $arch, $shape shape, $lanes lanes"
      # FAST_LIMIT (s) caps one run, so one slow compile cannot take the rest of the budget.
      limit=$(( $(left) - 5 )); [ "$limit" -gt "${FAST_LIMIT:-600}" ] && limit=${FAST_LIMIT:-600}
      # FAST_SCOPE: layer (default; one layer's graph, compiled once) or model (16 layers unrolled: on an H100 its
      # compile outran 100 s).
      timeout "$limit" python3 bench/benchmarks/bench_mfu.py --compile --compile-scope "${FAST_SCOPE:-layer}" \
        --attention flex --head-loss chunked \
        --archs "$arch" --lanes "$lanes" $widths --out "$OUT/mfu_cuda_fast_${shape}_${arch}_${lanes}.json" ${MFU_ARGS:-}
    done
    ;;
  peers)
    # The peers in this process on this GPU (bench_peers.py --device cuda): HF TransfoXL, labml-nn's Transformer-XL
    # and lucidrains' RMT beside memlm (plain and layers compiled), bf16, 64 lanes. Needs the peers' wheels in .whl
    # (bench/README.md). PEER_SHAPES: gpu-aligned (default) and/or gpu-paper.
    if [ "$(left)" -lt 120 ]; then stamp "skip peers: $(left) s left"; continue; fi
    stamp "peers on this GPU: ${PEER_SHAPES:-gpu-aligned}"
    timeout $(( $(left) - 5 )) python3 bench/benchmarks/bench_peers.py --device cuda \
      --shapes "${PEER_SHAPES:-gpu-aligned}" --precisions bf16 --out "$OUT/peers_cuda.json" ${PEER_ARGS:-}
    ;;
  profile)
    # The compiled step profiled per arch (bench_gpu_profile.py: phases, kernel categories, launches, syncs, graph
    # breaks, recompiles), each run in its own process. PROFILE_RUNS="SHAPE:ARCH:LANES:SCOPE ..." picks them
    # (default: the script's own), PROFILE_ARGS adds options.
    if [ "$(left)" -lt 90 ]; then stamp "skip profile: $(left) s left"; continue; fi
    stamp "profile of the compiled step: ${PROFILE_RUNS:-default runs}"
    runs=""; [ -n "${PROFILE_RUNS:-}" ] && runs="--runs $PROFILE_RUNS"
    timeout $(( $(left) - 5 )) python3 bench/benchmarks/bench_gpu_profile.py --out "$OUT" --budget-s $(( $(left) - 15 )) \
      $runs ${PROFILE_ARGS:-}
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
names = ["mfu_cuda.json", "mfu_cuda_fp32.json", "mfu_cuda_aligned.json", "mfu_cuda_compile_txl.json",
         "mfu_cuda_compile_lamemo.json"] + sorted(p.name for p in out.glob("mfu_cuda_fast_*.json"))
for name in names:
    p = out / name
    if p.exists():
        d = json.loads(p.read_text())
        print(f"{name} ({d['precision']}, {d['device'].get('name')}):")
        for r in d["rows"]:
            print(f"  {r['arch']:>11} {1e3 * r['step_s_median']:7.1f} ms {r['tokens_per_s']:9,.0f} tok/s "
                  f"{r['achieved_tflops']:6.1f} TFLOP/s MFU {100 * (r['mfu'] or 0):5.1f}% peak {r.get('peak_mem_gib', 0):5.1f} GiB"
                  f" warm-up {r.get('warmup_s', 0):5.0f} s recompiles {r.get('recompiles_after_warmup', '-')}")
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
