"""Whether the C++ table's kept cuBLASLt call (blockscale's rows, ``csrc/decode_calls.cpp``) gives
torch's ``_scaled_mm`` bits, per call shape and per workspace bound offered to its heuristic. One GPU::

    python3 -m scripts.probe_kept_cublaslt                         # the bound decode.lt_workspace_bytes gives
    python3 -m scripts.probe_kept_cublaslt --workspace-bytes 1048576

Per shape (Llama-3-8B and -70B down_proj) and M: the call is planned with the kept call whatever its
bits (``decode._same_bits``, the layer's guard, is bypassed here), then ``--tries`` fresh rows run
through the table with the kept call and with torch's call, and the bit-equal count is printed.
Run with ``CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE=lt_%i.log`` to see the bound each heuristic query
was given (torch 2.11 asked with 1 MiB on an H200, 2026-12-04: docs/decode.md).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workspace-bytes", type=int, help="the bound to ask the heuristic with (default: the rule's)")
    p.add_argument("-m", default="8,32,64")
    p.add_argument("--tries", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_kept_cublaslt: needs a GPU")
    from cco import quant as Q
    from kernels_fused.hopper import decode as D, native as NV

    if not NV.start(wait=300):
        raise SystemExit(f"probe_kept_cublaslt: the C++ table did not build: {NV.error()}")
    D._same_bits = lambda *a: True  # plan the kept call whatever its bits: compared below
    if args.workspace_bytes is not None:
        D.lt_workspace_bytes = lambda device: args.workspace_bytes
    table, g, differs = NV.TABLE, torch.Generator().manual_seed(0), 0
    for n, k in ((4096, 14336), (8192, 28672)):
        wq, ws = (t.cuda() for t in Q.quantize_b(torch.randn(n, k, generator=g) * 0.02, "blockscale"))
        for m in (int(v) for v in args.m.split(",")):
            D.decode_gemm(torch.randn(m, k, generator=g).to(torch.bfloat16).cuda(), wq, ws, "blockscale", n=n)
            same = 0
            for _ in range(args.tries):
                x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
                stream = torch._C._cuda_getCurrentRawStream(x.get_device())
                kept = table.run(x, wq, ws, None, n, D._QUANT_CODE["blockscale"], False, True, stream)
                theirs = table.run(x, wq, ws, None, n, D._QUANT_CODE["blockscale"], False, False, stream)
                same += kept is not None and bool(torch.equal(kept, theirs))
            differs += same != args.tries
            print(f"N {n} K {k} M {m}: kept call == torch's in {same} of {args.tries} tries "
                  f"({table.kept_error() or 'kept call planned'})", flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
