#!/usr/bin/env bash
# The whole NVIDIA GPU suite in one go (it cannot run in CI): every GPU test module on two ranks
# (two ranks share one GPU where there is only one: a CUDA IPC window), each bounded in time, then
# one summary line per module and the total. Exit status: the number of modules that failed.
#
#   bash scripts/gpu_suite.sh [LOG_DIR]          # logs per module under LOG_DIR (default: gpu-suite-logs)
#   CCO_GPU_SUITE_SKIP="cuda_hf" bash scripts/gpu_suite.sh   # all but the named modules
#   CCO_GPU_SUITE_BUDGET=580 bash scripts/gpu_suite.sh        # the whole run within 580 s: a module gets at
#                                                              # most what is left, one not started is FAILED
#   CCO_GPU_SUITE_FAULT_LANES=3 bash scripts/gpu_suite.sh     # the fault jobs last, three side by side
#
# Add a module to MODULES when it joins the suite. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir="${1:-gpu-suite-logs}"
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PYTHON:-python3}

# name | bound in seconds | command
FAULTS="$PY -m tests.python.cco.test_cuda_faults --launch --deadline 2 --timeout 150"  # 2 s: all nine jobs fit one call
MODULES=(  # the long-standing modules first, so a bound on the whole run cuts the newest ones
  "cuda_nn|180|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_nn"
  "cuda_op|240|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_op"
  "cuda_faults_dma|170|$FAULTS --transport dma"
  "cuda_faults_lsa|170|$FAULTS --transport lsa"
  "cuda_sp|180|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_sp"
  "cuda_hf|300|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_hf"
  "cuda_faults_rs_rows|170|$FAULTS --pattern reduce-scatter-rows"
  "cuda_faults_rs_cols|170|$FAULTS --pattern reduce-scatter-cols"
  "cuda_faults_ag|170|$FAULTS --pattern all-gather"
)
skip=" ${CCO_GPU_SUITE_SKIP:-} "  # module names to leave out of this run (say so where a run is quoted)
kept=()
for entry in "${MODULES[@]}"; do [[ "$skip" == *" ${entry%%|*} "* ]] || kept+=("$entry"); done
MODULES=("${kept[@]}")
for extra in ${CCO_GPU_SUITE_EXTRA:-}; do  # more modules: "name|bound|command" words, ';' for spaces
  MODULES+=("${extra//;/ }")
done

start_all=$(date +%s)
budget=${CCO_GPU_SUITE_BUDGET:-0}  # 0: no bound on the whole run
lanes=${CCO_GPU_SUITE_FAULT_LANES:-1}  # the fault jobs' lanes (1: one after another)

run_module() {  # name bound cmd: run it bounded, write its verdict line to $log_dir/$name.verdict
  local name=$1 bound=$2 cmd=$3 start left rc took skips verdict
  start=$(date +%s)
  if [ "$budget" -gt 0 ]; then
    left=$(( budget - (start - start_all) - 15 ))  # 15 s: the kill's grace below
    if [ "$left" -lt 30 ]; then
      printf '%-20s %-30s %5d s\n' "$name" "FAILED (not started: budget)" 0 >"$log_dir/$name.verdict"
      echo "[gpu-suite] $name: FAILED, not started: the ${budget}s budget is spent"
      return
    fi
    [ "$left" -lt "$bound" ] && bound=$left
  fi
  timeout --signal=TERM --kill-after=15 "$bound" bash -c "$cmd" >"$log_dir/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  skips=$(grep -c "_SKIPPED" "$log_dir/$name.log")  # sub-checks a module could not run here (it says why)
  if [ $rc -eq 0 ]; then verdict="passed$([ "$skips" -gt 0 ] && echo ", $skips skipped")"; else verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"; fi
  printf '%-20s %-30s %5d s\n' "$name" "$verdict" "$took" >"$log_dir/$name.verdict"
  echo "[gpu-suite] $name: $verdict in ${took}s"
  [ $rc -eq 0 ] || tail -n 40 "$log_dir/$name.log"
  grep "_SKIPPED" "$log_dir/$name.log"
}

# Every module but the fault jobs one after another; then the fault jobs, in $lanes lanes side by
# side. A fault job mostly waits out deadlines, so lanes of them overlap well; the compile- and
# GEMM-heavy modules never run beside them (side by side with those, a fault job ran 1.8x slower
# and outran its bound: docs/experiments.md, 2026-12-03).
rm -f "$log_dir"/*.verdict
faults=()
for entry in "${MODULES[@]}"; do
  IFS='|' read -r name bound cmd <<<"$entry"
  if [[ "$name" == cuda_faults* && "$lanes" -gt 1 ]]; then faults+=("$entry"); else run_module "$name" "$bound" "$cmd"; fi
done
for ((lane = 0; lane < lanes && ${#faults[@]} > 0; lane++)); do
  (for ((i = lane; i < ${#faults[@]}; i += lanes)); do
     IFS='|' read -r name bound cmd <<<"${faults[$i]}"
     run_module "$name" "$bound" "$cmd"
   done) &
done
wait

failed=0
echo "[gpu-suite] ---- summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%dT%H:%MZ))"
for entry in "${MODULES[@]}"; do
  name=${entry%%|*}
  line=$(cat "$log_dir/$name.verdict" 2>/dev/null || printf '%-20s %-30s' "$name" "FAILED (no verdict)")
  echo "$line"
  [[ "$line" == *FAILED* ]] && failed=$((failed + 1))
done
echo "[gpu-suite] $(( ${#MODULES[@]} - failed )) passed, $failed failed in $(( $(date +%s) - start_all )) s"
exit $failed
