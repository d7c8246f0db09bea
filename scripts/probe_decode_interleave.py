"""Whether interleaving the cco layer's decode call with ``nn.Linear`` (cuBLAS) costs the host more
than each call alone (one GPU)::

    python3 -m scripts.probe_decode_interleave --json interleave.json

Why: in ``bench_decode``'s model the eager step with o_proj and down_proj in fp8 (cco) and the other
linears bf16 costs more host time than bf16's or every linear's in fp8, and the excess is spread
over the step: the ``nn.Linear`` calls after a cco call and the step's other torch ops
(``probe_decode_model_host``). Here single calls repeat in fixed sequences, and each sequence's host
time per round is compared with the sum of its calls' times alone (``excess``; positive: the calls
slow each other down). Calls, all at one row of Llama-3-8B's o_proj shape (4096 x 4096): ``L``
``nn.Linear`` bf16, ``R`` ``cco.nn.RowParallelLinear`` (world 1, the decode GEMM's call), ``E`` a
torch elementwise op (``x * 2``), ``N`` ``F.rms_norm``, ``T`` a one-program Triton kernel through
Triton's own launcher. Rounds of each sequence alternate with the other sequences' (passes in
rotated order); medians over passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SEQUENCES = ("L", "R", "E", "N", "T", "LE", "RE", "LN", "RN", "LR", "LRE", "LENR", "LT", "TE", "LTE")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="host time of interleaved decode-sized calls")
    p.add_argument("--quant", default="ptpc")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--sequences", default=",".join(SEQUENCES))
    p.add_argument("--json")
    args = p.parse_args(argv)
    import triton
    import triton.language as tl

    from cco.bench.timing import require_cuda
    from kernels_fused.hopper import native as NV
    from scripts import bench_decode as B

    require_cuda("probe_decode_interleave")
    device = torch.device("cuda", torch.cuda.current_device())

    @triton.jit
    def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    comm = B.launched_or_one_rank(device)
    with comm:
        native = "loaded" if NV.ENABLED and NV.start(wait=600) else "off"
        lin = torch.nn.Linear(4096, 4096, bias=False, device=device, dtype=torch.bfloat16)
        row = B.cco_layer(lin, args.quant, comm, m_max=64)
        x = torch.randn(1, 1, 4096, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        calls = {"L": lambda: lin(x), "R": lambda: row(x), "E": lambda: x * 2,
                 "N": lambda: torch.nn.functional.rms_norm(x, (4096,)),
                 "T": lambda: _scale[(1,)](x, y, 4096, BLOCK=4096)}
        seqs = args.sequences.split(",")
        fns = {s: [calls[c] for c in s] for s in seqs}
        with torch.no_grad():
            for s in seqs:
                for f in fns[s] * 50:
                    f()
            torch.cuda.synchronize()
            times = {s: [] for s in seqs}
            for p_ in range(args.passes):
                for s in seqs[p_ % len(seqs):] + seqs[:p_ % len(seqs)]:
                    fs = fns[s]
                    t0 = time.perf_counter()
                    for _ in range(args.rounds):
                        for f in fs:
                            f()
                    times[s].append((time.perf_counter() - t0) / args.rounds * 1e6)
                    torch.cuda.synchronize()
        med = {s: statistics.median(v) for s, v in times.items()}
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "native": native, "quant": args.quant,
               "CCO_DECODE_NATIVE": os.environ.get("CCO_DECODE_NATIVE"), "rows": []}
        for s in seqs:
            alone = sum(med[c] for c in s) if all(c in med for c in s) else None
            rec = {"sequence": s, "host_us_per_round": med[s], "passes": times[s],
                   "sum_alone_us": alone, "excess_us": None if alone is None else med[s] - alone}
            out["rows"].append(rec)
            print(f"{s:6s} {med[s]:7.1f} us/round (min {min(times[s]):6.1f} max {max(times[s]):6.1f})"
                  + ("" if alone is None or len(s) == 1 else f"  alone-sum {alone:7.1f}  excess {med[s] - alone:+6.1f}"),
                  flush=True)
        row.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
