"""Host time of one stream write-value, wait and copy through cuda-python against the decode
extension's C++ functions (``cco.cuda.memops``, ``csrc/stream_memops.cpp``), one GPU::

    python3 -m scripts.probe_memops_host [--passes 15] [--calls 2000]

Per pass and arm: ``--calls`` calls back to back (after 100 warm-up calls), host us per call until
the last returns; the arms alternate within each pass (cuda-python first in even passes, the C++
one first in odd ones) and a line gives the median over passes of each. The stream waits for a
word already written (the wait passes at once) and copies 8 bytes, so the device never falls
behind by much; it is synchronized between arms.
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_memops_host: needs a GPU")
    from cco.cuda import memops
    from kernels_fused.hopper import native as NV

    if not NV.start(wait=300):
        raise SystemExit(f"probe_memops_host: the extension is not loaded: {NV.error()}")
    words = torch.zeros(4, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream().cuda_stream
    a, b = words.data_ptr(), words.data_ptr() + 8
    arms = {  # op -> arm -> fn(): the same call through each path
        "write": {"cuda-python": lambda: memops._cuda_write(stream, a, 1),
                  "native": lambda: NV.MODULE.stream_write_value64(stream, a, 1)},
        "wait_geq": {"cuda-python": lambda: memops._cuda_wait_geq(stream, a, 0),
                     "native": lambda: NV.MODULE.stream_wait_value64_geq(stream, a, 0)},
        "copy 8 B": {"cuda-python": lambda: memops._cuda_copy(stream, b, a, 8),
                     "native": lambda: NV.MODULE.memcpy_async(stream, b, a, 8)},
    }
    for op, fns in arms.items():
        times = {arm: [] for arm in fns}
        for p in range(args.passes):
            for arm in (list(fns) if p % 2 == 0 else list(fns)[::-1]):
                fn = fns[arm]
                for _ in range(100):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[arm].append((time.perf_counter() - t0) / args.calls * 1e6)
                torch.cuda.synchronize()
        print(f"{op:10s} " + "  ".join(f"{arm} {statistics.median(t):6.2f} us" for arm, t in times.items())
              + f"  (median of {args.passes} passes of {args.calls} calls)", flush=True)


if __name__ == "__main__":
    main()
