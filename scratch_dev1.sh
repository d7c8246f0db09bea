set -x
mkdir -p $OUT/logs
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
timeout 200 python3 -m kernels_fused.hopper.native --build > $OUT/logs/build.log 2>&1; echo build rc $?
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scratch_dev1.py > $OUT/logs/checks.log 2>&1; echo checks rc $?
tail -8 $OUT/logs/checks.log
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.python.cco.test_cuda_op --quant mxfp8 > $OUT/logs/cuda_op_mxfp8.log 2>&1; echo cuda_op rc $?
tail -4 $OUT/logs/cuda_op_mxfp8.log
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m scripts.bench_decode --per-call-only --shapes 8b-down-tp2 -m 1,8 --quant ptpc,mxfp8 --calls 30 --json $OUT/w2_dense_b.json > $OUT/logs/w2.log 2>&1; echo w2 rc $?
tail -30 $OUT/logs/w2.log
