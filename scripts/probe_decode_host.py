"""Where an eager decode call of 8 rows spends its host time, piece by piece (one GPU), for mxfp8
(its rows through the C++ table over the bf16 copy of the weight) and blockscale (its kept
cuBLASLt call), at Llama-3-8B's down_proj and o_proj shapes::

    python3 -m scripts.probe_decode_host

Each line: 300 back-to-back calls after 20 warm-up calls, host us per call (until the last call
returns) and wall us per call (after a device wait). One process, world 1 (a gloo group of one on
port 29511). Results of 2026-12-04: docs/results/2026-12-04_decode_afternoon/probe_decode_host_8rows.log.
"""

import argparse
import time

import torch


def timed(name, fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    print(f"{name:48s} host {host:7.1f} us  wall {wall:7.1f} us", flush=True)


def main(argv=None) -> None:
    # no options, but argparse first: --help prints the usage and exits 0 (on a CPU too), an unknown
    # argument is a usage error, not a run
    argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", "").rstrip(":")
                            + ".").parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_host: needs a GPU")
    import torch.distributed as dist

    from cco.comm import Communicator
    from cco.nn import RowParallelLinear
    from kernels_fused.hopper import decode as D, native as NV
    from kernels_fused.hopper.quantize import quantize_activation
    from kernels_fused.hopper.vendor import mx_to_bf16

    NV.start(wait=300)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    comm = Communicator.from_group(dist.group.WORLD, device=torch.device("cuda", 0))
    for quant in ("mxfp8", "blockscale"):
        for n, k in ((4096, 14336), (4096, 4096)):
            layer = RowParallelLinear(k, n, group=comm, quant=quant, m_max=256)
            layer.load_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16).cuda())
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(8, k, dtype=torch.bfloat16, device="cuda")
            qw, sc = layer.quantized_weight()
            print(f"--- {quant} N {n} K {k} M 8", flush=True)
            with torch.no_grad():
                timed("nn.Linear", lambda: lin(x))
                timed("layer", lambda: layer(x))
                if quant == "mxfp8":
                    dense = layer.op.vendor_weight(qw, sc).dense
                    timed("op.vendor_weight", lambda: layer.op.vendor_weight(qw, sc))
                    timed("decode_gemm(dense) via table", lambda: D.decode_gemm(x, dense, sc, quant, n=n))
                    stream = torch.cuda.current_stream().cuda_stream
                    timed("table.run alone", lambda: NV.TABLE.run(x, dense, sc, None, n, 2, True, True, stream))
                    timed("table.run, kept call off (at::mm)",
                          lambda: NV.TABLE.run(x, dense, sc, None, n, 2, True, False, stream))
                    a, s = quantize_activation(x, quant, k_padded=k)
                    ab = mx_to_bf16(a, s)
                    out = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
                    timed("torch.matmul(out=)", lambda: torch.matmul(ab, dense.t(), out=out))
                    timed("torch.mm", lambda: torch.mm(ab, dense.t()))
                    timed("quantize_activation", lambda: quantize_activation(x, quant, k_padded=k))
                    timed("mx_to_bf16", lambda: mx_to_bf16(a, s))
                    timed("F.linear(ab, dense)", lambda: torch.nn.functional.linear(ab, dense))
                else:
                    timed("decode_gemm(fp8) via table", lambda: D.decode_gemm(x, qw, sc, quant, n=n))
            print("taken", NV.TABLE.taken(), NV.TABLE.kept_taken(), flush=True)
            layer.close()


if __name__ == "__main__":
    main()
