set -x
mkdir -p $OUT/logs
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 200 python3 -m kernels_fused.hopper.native --build > $OUT/logs/build.log 2>&1; echo build rc $?
timeout 120 python3 -m scripts.probe_memops_host --passes 9 --calls 2000 > $OUT/logs/probe_memops.log 2>&1; echo probe rc $?
tail -6 $OUT/logs/probe_memops.log
for run in off1 on1 off2 on2; do
  arm=${run%?}
  if [ $arm = off ]; then export CCO_MEMOPS_NATIVE=0; else export CCO_MEMOPS_NATIVE=1; fi
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m scripts.bench_decode --per-call-only --shapes 8b-down-tp2 -m 1,8 --quant ptpc,mxfp8 --calls 30 --json $OUT/w2_memops_$run.json > $OUT/logs/w2_memops_$run.log 2>&1; echo w2 $run rc $?
  grep "M=" $OUT/logs/w2_memops_$run.log | tail -2
done
unset CCO_MEMOPS_NATIVE
timeout 120 python3 -m scripts.bench_sp_parts --pattern rs-rows --tp 2,4,8 -m 4096,16384 --passes 3 --iters 5 --json $OUT/sp_rs.json --plot $OUT/sp_rs.png > $OUT/logs/sp_rs.log 2>&1; echo rs rc $?
grep -v "^\[" $OUT/logs/sp_rs.log | tail -40
timeout 120 python3 -m scripts.bench_sp_parts --pattern ag --tp 2,4,8 -m 4096,16384 --passes 3 --iters 5 --json $OUT/sp_ag.json --plot $OUT/sp_ag.png > $OUT/logs/sp_ag.log 2>&1; echo ag rc $?
grep -v "^\[" $OUT/logs/sp_ag.log | tail -40
cd $OUT && tar czf results.tgz logs *.json *.png && rm -rf logs *.json && ls
