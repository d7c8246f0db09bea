#!/usr/bin/env bash
# The whole NVIDIA GPU suite in one go (it cannot run in CI): every GPU test module on two ranks
# (two ranks share one GPU where there is only one: a CUDA IPC window), each bounded in time, then
# one summary line per module and the total. Exit status: the number of modules that failed (2 before
# any module: a usage error, or a host whose torch sees no NVIDIA GPU).
#
#   bash scripts/gpu_suite.sh [LOG_DIR]          # logs per module under LOG_DIR (default: gpu-suite-logs)
#   CCO_GPU_SUITE_SKIP="cuda_hf" bash scripts/gpu_suite.sh   # all but the named modules
#   CCO_GPU_SUITE_LIST=1 CCO_GPU_SUITE_PART=1 bash scripts/gpu_suite.sh  # the modules it would run, no GPU
#   CCO_GPU_SUITE_TREE=1 bash scripts/gpu_suite.sh            # the tree's digest, no GPU (below)
#   CCO_GPU_SUITE_BUDGET=580 bash scripts/gpu_suite.sh        # the whole run within 580 s: a module starts
#                                                              # only where what is left holds its TYPICAL
#                                                              # time (else the next that fits goes first),
#                                                              # gets at most what is left; one not started
#                                                              # is FAILED (resume it in the next call)
#   CCO_GPU_SUITE_PART=1 bash scripts/gpu_suite.sh            # the build, the all-reduce's op, layer and fault
#                                                              # jobs and the all-gather's (~330-440 s, one H200)
#   CCO_GPU_SUITE_PART=2 bash scripts/gpu_suite.sh            # the build, the sequence-parallel ops, the
#                                                              # transformers checks, the reduce-scatter's
#                                                              # fault jobs (~320-420 s)
#
# All ten modules one after another take ~650-850 s on one H200 with two ranks sharing it (a slow lend
# ran each module 5-60% longer: 2026-12-04 night, docs/experiments.md), more than one 10-minute call of
# a lent machine: there, run part 1 and part 2 as two calls on the same tree (each part builds, or
# finds, the C++ decode table first).
#
# The code a run tested: every .py, .cpp, .cu, .h and .sh file under cco, kernels_fused, tests/python and
# scripts, one sha1 a file (LOG_DIR/tree.sha1), sorted by the path's bytes (a locale's order differs
# between machines: a digest over `sort`'s order did), and that list's digest in the summary. Compare
# it with CCO_GPU_SUITE_TREE=1 run where the code was written; where they differ, `diff` the lists.
#
# A whole suite over several calls (a slow lend ran part 1 past its budget, 2026-12-06): each module
# that passes is recorded in LOG_DIR/passed.txt with the tree's digest; with CCO_GPU_SUITE_RESUME=1 a
# module recorded as passed on this same tree is not run again and counts as passed (its summary line
# says when, and how many of its sub-checks were skipped then); a module that fails loses its
# record. native_build always runs (a fresh machine has no build). Keep LOG_DIR between calls (an
# ignored folder in the checkout, carried to the next call):
#   CCO_GPU_SUITE_RESUME=1 CCO_GPU_SUITE_PACK=$OUT/suite.tgz bash scripts/gpu_suite.sh gpu-suite-logs
# CCO_GPU_SUITE_PACK=FILE.tgz packs LOG_DIR into one file at the end (a lent machine returns 8 files).
#
# Add a module to MODULES when it joins the suite. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,/^set -uo/p' scripts/gpu_suite.sh | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) echo "gpu_suite.sh: unknown option '$1'; the one argument is LOG_DIR (--help)" >&2; exit 2 ;;
esac
log_dir="${1:-gpu-suite-logs}"
tree_files() {
  find cco kernels_fused tests/python scripts -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.sh' \) \
    -print0 | LC_ALL=C sort -z | xargs -0 sha1sum
}
if [ -n "${CCO_GPU_SUITE_TREE:-}" ]; then
  tree_files | sha1sum | cut -c1-12
  exit 0
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=${PYTHON:-python3}

# name | bound in seconds | command
FAULTS="$PY -m tests.python.cco.test_cuda_faults --launch --deadline 2 --timeout 150"  # 2 s: a job ~70 s, not ~90
MODULES=(  # the long-standing modules first, so a bound on the whole run cuts the newest ones
  # the decode GEMM's C++ call path, built once for the machine before the modules that use it
  # (each process would otherwise start the build and wait for it within its own bound)
  "native_build|150|$PY -m kernels_fused.hopper.native --build"
  "cuda_nn|240|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_nn"
  "cuda_op|240|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_op"
  "cuda_faults_dma|170|$FAULTS --transport dma"
  "cuda_faults_lsa|170|$FAULTS --transport lsa"
  "cuda_sp|180|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_sp"
  "cuda_hf|300|$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_hf"
  "cuda_faults_rs_rows|170|$FAULTS --pattern reduce-scatter-rows"
  "cuda_faults_rs_cols|170|$FAULTS --pattern reduce-scatter-cols"
  "cuda_faults_ag|170|$FAULTS --pattern all-gather"
)
# Seconds each module took on a slow lend (one H100, 2026-12-06): under a budget a module starts only
# where what is left holds this much, so that the budget is not spent on a module cut at its end (a
# call of that day spent 127 s on cuda_hf twice so). A module not listed here is always started.
declare -A TYPICAL=([native_build]=40 [cuda_nn]=95 [cuda_op]=110 [cuda_faults_dma]=80 [cuda_faults_lsa]=80
                    [cuda_sp]=60 [cuda_hf]=130 [cuda_faults_rs_rows]=75 [cuda_faults_rs_cols]=75
                    [cuda_faults_ag]=80)
PART1="cuda_nn cuda_op cuda_faults_dma cuda_faults_lsa cuda_faults_ag"  # (native_build: in both parts)
PART2="cuda_sp cuda_hf cuda_faults_rs_rows cuda_faults_rs_cols"
case "${CCO_GPU_SUITE_PART:-all}" in
  all) part_skip="" ;;
  1) part_skip="$PART2" ;;
  2) part_skip="$PART1" ;;
  *) echo "CCO_GPU_SUITE_PART must be 1, 2 or all, got '$CCO_GPU_SUITE_PART'" >&2; exit 2 ;;
esac
skip=" ${CCO_GPU_SUITE_SKIP:-} $part_skip "  # module names to leave out of this run (say so where a run is quoted)
kept=()
for entry in "${MODULES[@]}"; do [[ "$skip" == *" ${entry%%|*} "* ]] || kept+=("$entry"); done
MODULES=("${kept[@]}")
for extra in ${CCO_GPU_SUITE_EXTRA:-}; do  # more modules: "name|bound|command" words, ';' for spaces
  MODULES+=("${extra//;/ }")
done
if [ -n "${CCO_GPU_SUITE_LIST:-}" ]; then  # the modules this run would run, a name a line; runs nothing
  printf '%s\n' "${MODULES[@]%%|*}"
  exit 0
fi
# a CPU host would run every module to a traceback (and cuda_hf, which also runs on CPU ranks, to a
# pass that proves nothing of the GPU): refuse before the first one
if ! $PY -c "import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_suite.sh: needs an NVIDIA GPU and a CUDA build of torch ($PY sees none); the CPU suite is python3 -m pytest" >&2
  exit 2
fi
mkdir -p "$log_dir" || { echo "gpu_suite.sh: cannot make the log folder '$log_dir'" >&2; exit 2; }
tree_files >"$log_dir/tree.sha1"
tree=$(sha1sum <"$log_dir/tree.sha1" | cut -c1-12)
echo "[gpu-suite] tree $tree (its files: $log_dir/tree.sha1)"

start_all=$(date +%s)
budget=${CCO_GPU_SUITE_BUDGET:-0}  # 0: no bound on the whole run

failed=0
earlier=0  # modules counted as passed from LOG_DIR/passed.txt (CCO_GPU_SUITE_RESUME)
passed_file="$log_dir/passed.txt"
touch "$passed_file"
summary=()
verdict_of() {  # name verdict seconds: the module's summary line
  summary+=("$(printf '%-20s %-30s %5d s' "$1" "$2" "$3")")
  [[ "$2" == FAILED* ]] && failed=$((failed + 1))
  return 0
}
for entry in "${MODULES[@]}"; do  # one after another: side by side on one GPU, fault jobs ran 2-4x slower
  IFS='|' read -r name bound cmd <<<"$entry"  # and broke their time bounds (docs/experiments.md, 2026-12-03)
  if [ -n "${CCO_GPU_SUITE_RESUME:-}" ] && [ "$name" != native_build ] \
      && record=$(grep -m1 "^$name $tree " "$passed_file"); then
    read -r _ _ took when skips <<<"$record"
    verdict_of "$name" "passed earlier ($when)$([ "${skips:-0}" -gt 0 ] && echo ", $skips skipped")" "$took"
    earlier=$((earlier + 1))
    echo "[gpu-suite] $name: passed earlier on this tree ($when, ${took}s): not run again"
    continue
  fi
  start=$(date +%s)
  cut=""  # the module's bound is what is left of the budget
  if [ "$budget" -gt 0 ]; then
    left=$(( budget - (start - start_all) - 15 ))  # 15 s: the kill's grace below
    typical=${TYPICAL[$name]:-0}
    if [ "$left" -lt 30 ] || [ "$left" -lt "$typical" ]; then
      verdict_of "$name" "FAILED (not started: budget)" 0
      echo "[gpu-suite] $name: FAILED, not started: ${left}s of the ${budget}s budget left, it takes ~${typical}s"
      continue
    fi
    [ "$left" -lt "$bound" ] && bound=$left && cut=", cut at the budget's end"
  fi
  timeout --signal=TERM --kill-after=15 "$bound" bash -c "$cmd" >"$log_dir/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  skips=$(grep -c "_SKIPPED" "$log_dir/$name.log")  # sub-checks a module could not run here (it says why)
  if [ $rc -eq 0 ]; then verdict="passed$([ "$skips" -gt 0 ] && echo ", $skips skipped")"; else verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out$cut"))"; fi
  verdict_of "$name" "$verdict" "$took"
  grep -v "^$name $tree " "$passed_file" >"$passed_file.new"; mv "$passed_file.new" "$passed_file"
  [ $rc -eq 0 ] && echo "$name $tree $took $(date -u +%Y-%m-%dT%H:%MZ) $skips" >>"$passed_file"
  echo "[gpu-suite] $name: $verdict in ${took}s"
  [ $rc -eq 0 ] || tail -n 40 "$log_dir/$name.log"
  grep "_SKIPPED" "$log_dir/$name.log"
done

echo "[gpu-suite] ---- summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%dT%H:%MZ), tree $tree)"
printf '%s\n' "${summary[@]}"
echo "[gpu-suite] $(( ${#MODULES[@]} - failed )) passed$([ "$earlier" -gt 0 ] && echo " ($earlier of them in an earlier run on this tree)"), $failed failed in $(( $(date +%s) - start_all )) s"
if [ -n "${CCO_GPU_SUITE_PACK:-}" ]; then
  tar czf "$CCO_GPU_SUITE_PACK" -C "$(dirname "$log_dir")" "$(basename "$log_dir")" \
    || echo "[gpu-suite] could not pack $log_dir into $CCO_GPU_SUITE_PACK" >&2
fi
exit $failed
