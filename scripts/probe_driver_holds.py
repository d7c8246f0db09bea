"""Which CUDA driver calls of one host thread wait while another thread waits on a stuck stream.

    python3 -m scripts.probe_driver_holds > holds.txt      (one NVIDIA GPU; ~4 minutes)

Why: the op's watchdog (``cco/cuda/watchdog.py``) must release a call whose stream waits for a word
no peer will write, from its own thread, while the caller's thread may be waiting on that call in
the driver. Which of the release's calls go through then decides what the release may be made of.

Each case runs in a process of its own (a case that hangs is killed at 25 s and reported as such).
A stream ``s1`` waits (``cuStreamWaitValue64``) on a word nobody writes, then copies (``copy``:
``cuMemcpyAsync``) or computes (``kernel``: ``y = x * 2``); the caller's stream waits for ``s1``,
eagerly (``eager_*``) or as a replay of a CUDA graph captured from the same work (``graph_*``).
The main thread then waits in one host call: ``cpu`` (``y.cpu()``, a 2 MiB copy to pageable
memory), ``item`` (``y[0].item()``), ``sync`` (``torch.cuda.synchronize()``), ``stream_sync``.
Half a second later a helper thread tries, each on a fresh thread given 1 s, on a stream of its
own: a copy to pinned memory, a device copy, an event record, a memset, a stream write-value, a
kernel launch, an event query, a stream creation; then it releases the wait, by a write-value of
the word (``dev``) or, with the word in pinned host memory (``host``), by a plain store. Printed
per case: each call's seconds, or ``BLOCKED``; and when the main thread's wait returned.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

CALLS = ("d2h_pinned", "d2d", "event_record", "memset", "write_value", "launch", "event_query", "stream_create")
CASE_TIMEOUT_S = 25
SHAPES = ("eager_copy", "eager_kernel", "graph_copy", "graph_kernel")
BLOCKS = ("cpu", "item", "sync", "stream_sync")
WORDS = ("dev", "host")


def case(shape: str, block: str, wait_on: str) -> None:
    import torch

    from cco.cuda import memops
    torch.cuda.set_device(0)
    dev = torch.zeros(4, dtype=torch.int64, device="cuda")
    host = torch.zeros(4, dtype=torch.int64).pin_memory()
    word = dev if wait_on == "dev" else host
    x = torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    scratch = torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16)
    (scratch + 1).sum().item()  # the helper's kernel, loaded now
    s1 = torch.cuda.Stream()

    def enqueue():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        memops.wait_geq(s1.cuda_stream, word.data_ptr(), 1)
        if "copy" in shape:
            memops.copy(s1.cuda_stream, y.data_ptr(), x.data_ptr(), x.numel() * 2)
        else:  # x * 2 is first loaded here, behind the wait, in the eager case
            with torch.cuda.stream(s1):
                y.copy_(x * 2)
        cur.wait_stream(s1)

    if shape.startswith("graph"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            enqueue()
        torch.cuda.synchronize()
        graph.replay()
    else:
        enqueue()
    log = {}
    rel = memops.stream_create()
    buf = torch.zeros(16, dtype=torch.int64).pin_memory()
    ev = torch.cuda.Event()

    def attempt(name):
        torch.cuda.set_device(0)
        t = time.monotonic()
        if name == "d2h_pinned":
            memops.copy(rel, buf.data_ptr(), scratch.data_ptr(), 8)
        elif name == "d2d":
            memops.copy(rel, scratch.data_ptr() + 64, scratch.data_ptr(), 8)
        elif name == "event_record":
            ev.record(torch.cuda.ExternalStream(rel))
        elif name == "memset":
            memops.fill(rel, scratch.data_ptr(), 0xFF, 64)
        elif name == "write_value":
            memops.write(rel, scratch.data_ptr() + 128, 7)
        elif name == "launch":
            with torch.cuda.stream(torch.cuda.ExternalStream(rel)):
                scratch.add_(1)
        elif name == "event_query":
            ev.query()
        elif name == "stream_create":
            memops.stream_create()
        log[name] = round(time.monotonic() - t, 3)

    def helper():
        torch.cuda.set_device(0)
        time.sleep(0.5)
        for name in CALLS:
            th = threading.Thread(target=attempt, args=(name,), daemon=True)
            th.start()
            th.join(1.0)
            if th.is_alive():
                log[name] = "BLOCKED"
        if wait_on == "host":
            host[0] = 1  # a plain store: no driver call
            log["release"] = "host store"
        else:
            th = threading.Thread(target=lambda: memops.write(rel, dev.data_ptr(), 1), daemon=True)
            th.start()
            th.join(2.0)
            log["release"] = "write_value " + ("BLOCKED" if th.is_alive() else "issued")

    th = threading.Thread(target=helper, daemon=True)
    th.start()
    t0 = time.monotonic()
    if block == "cpu":
        y.cpu()
    elif block == "item":
        y[0].item()
    elif block == "sync":
        torch.cuda.synchronize()
    elif block == "stream_sync":
        torch.cuda.current_stream().synchronize()
    th.join()
    log["main_returned_s"] = round(time.monotonic() - t0, 3)
    print("RESULT " + json.dumps(log), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("case", nargs="*", help=f"SHAPE BLOCK WORD: that one case, in this process (SHAPE of "
                                           f"{', '.join(SHAPES)}; BLOCK of {', '.join(BLOCKS)}; WORD of "
                                           f"{', '.join(WORDS)}); none: every case, each in a child process")
    args = p.parse_args(argv)
    if args.case and (len(args.case) != 3 or args.case[0] not in SHAPES or args.case[1] not in BLOCKS
                      or args.case[2] not in WORDS):
        p.error(f"a case is SHAPE BLOCK WORD (SHAPE of {', '.join(SHAPES)}; BLOCK of {', '.join(BLOCKS)}; WORD of "
                f"{', '.join(WORDS)}), got {' '.join(args.case)}")
    return args


def main() -> None:
    from cco.bench.timing import require_cuda

    require_cuda("probe_driver_holds")  # else every case fails in its child, one traceback each
    cases = [(shape, block, "dev") for shape in SHAPES for block in BLOCKS]
    cases += [("eager_copy", "cpu", "host"), ("eager_kernel", "cpu", "host"), ("graph_copy", "cpu", "host"),
              ("eager_copy", "sync", "host")]
    for c in cases:
        try:
            r = subprocess.run([sys.executable, "-m", "scripts.probe_driver_holds", *c], capture_output=True,
                               text=True, timeout=CASE_TIMEOUT_S)
            lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
            res = lines[-1] if lines else f"rc={r.returncode} {r.stderr[-600:]}"
        except subprocess.TimeoutExpired as e:
            res = f"HUNG (killed at {CASE_TIMEOUT_S} s) " + str((e.stdout or b"")[-300:])
        print(c, res, flush=True)


if __name__ == "__main__":
    # argparse first: --help prints the usage and exits 0 rather than running every case (~4 minutes)
    chosen = parse_args().case
    if chosen:
        case(*chosen)
    else:
        main()
