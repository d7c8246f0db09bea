"""Where a decode-sized eager call of the layer spends its host time, per rank: ``RowParallelLinear``'s
call at M rows timed back to back, then each call issued on an idle queue (the GPU synchronized
before it: its own host cost, not the back-pressure of a device that runs behind), then the same
idle-queue calls under cProfile (tottime and cumulative, the project's own functions). Run it at
world 1 or under torchrun (two ranks may share one GPU: the host time is real there)::

    python3 -m scripts.profile_decode_call --quant ptpc -n 4096 -k 7168 -m 8 --out prof
    torchrun --nproc-per-node 2 -m scripts.profile_decode_call --quant ptpc -n 4096 -k 7168 -m 8 --out prof

Writes ``OUT/rank{r}.txt`` (the profile) and prints each rank's host and wall us per call (the
first line of that file).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="ptpc", choices=("ptpc", "blockscale", "mxfp8"))
    p.add_argument("-n", type=int, default=4096, help="out_features")
    p.add_argument("-k", type=int, default=7168, help="in_features_per_rank")
    p.add_argument("-m", type=int, default=8, help="rows per call")
    p.add_argument("--calls", type=int, default=200, help="calls per measurement (three: back to back, each on an "
                                                         "idle queue, each on an idle queue under cProfile)")
    p.add_argument("--out", default="profile_decode_call")
    args = p.parse_args(argv)
    if min(args.n, args.k, args.m, args.calls) < 1:
        raise SystemExit("profile_decode_call: -n, -k, -m and --calls must be >= 1")

    from cco.nn import RowParallelLinear
    from scripts.bench_decode import launched_or_one_rank

    comm = launched_or_one_rank(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    device = comm.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(comm.rank)
    layer = RowParallelLinear(args.k, args.n, group=comm, quant=args.quant, m_max=max(args.m, 64))
    layer.load_weight((torch.randn(args.n, args.k, generator=g) / args.k ** 0.5).to(torch.bfloat16).to(device))
    x = torch.randn(args.m, args.k, generator=g).to(torch.bfloat16).to(device)
    with torch.no_grad():
        for _ in range(20):  # first calls: plans, builds, kept launches
            layer(x)
        sync()
        comm.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            layer(x)
        host = (time.perf_counter() - start) / args.calls * 1e6
        sync()
        wall = (time.perf_counter() - start) / args.calls * 1e6
        # each call issued on an idle queue: its own host cost, without the back-pressure of a device
        # that runs behind (two ranks time-slicing one GPU run far behind their hosts)
        issue, prof = [], cProfile.Profile()
        for profiled in (False, True):
            for _ in range(args.calls):
                sync()
                start = time.perf_counter()
                if profiled:
                    prof.enable()
                layer(x)
                if profiled:
                    prof.disable()
                else:
                    issue.append((time.perf_counter() - start) * 1e6)
        sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(r"cco/|kernels_fused/", 30)
    os.makedirs(args.out, exist_ok=True)
    issue.sort()
    head = (f"rank {comm.rank}/{comm.world} {args.quant} N={args.n} K={args.k} M={args.m}: back to back host "
            f"{host:.1f} us, wall {wall:.1f} us per call; issued on an idle queue: median {issue[len(issue) // 2]:.1f} "
            f"us ({issue[len(issue) // 10]:.1f}..{issue[-1 - len(issue) // 10]:.1f}, 10th..90th percentile) "
            f"({args.calls} calls each, decode_rows {layer.decode_rows}); the profile: the idle-queue calls")
    with open(os.path.join(args.out, f"rank{comm.rank}.txt"), "w") as f:
        f.write(head + "\n\n" + text.getvalue())
    print(head, flush=True)
    layer.close()
    comm.close()


if __name__ == "__main__":
    main()
