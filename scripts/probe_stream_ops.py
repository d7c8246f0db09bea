"""Device time of the copy-engine schedule's stream operations, each kind in a captured CUDA graph
(what a replayed or eager schedule pays on its stream, host time aside): stream write-values, stream
waits on words already set, a wait and a write per word (a consumed flag before 2026-12-04), memsets
of a flag row (a consumed flag since), 8-byte copies (a peer's flag set by copy), a torch fill of the
same words and the all-gather's block wait over them (``memops.wait_block_kernel``, one spin
launch), against an empty graph. The words are the flags of an all-gather call at W = 8 with
4 chunks (7 sources x 4 chunks = 28 words, rows of ``MAX_CHUNKS``)::

    python3 -m scripts.probe_stream_ops --json stream_ops.json

Per arm, ``--reps`` copies of the sequence per graph, ``--replays`` replays per pass, ``--passes``
passes in turn; prints the median (range over passes) in us per sequence and writes the per-pass
figures to the JSON. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def arms(words: torch.Tensor, one: torch.Tensor, *, sources: int, chunks: int):
    """name -> fn(stream handle): one sequence of stream operations on ``words`` ([W, MAX_CHUNKS] int64)."""
    from cco.cuda import memops

    row = words.stride(0) * 8

    def addr(s, c):
        return words.data_ptr() + s * row + c * 8

    flags = [(s, c) for c in range(chunks) for s in range(1, sources + 1)]

    def writes(st):
        for s, c in flags:
            memops.write(st, addr(s, c), 0)

    def waits(st):
        for s, c in flags:
            memops.wait_geq(st, addr(s, c), 0)

    def wait_and_write(st):
        for s, c in flags:
            memops.wait_geq(st, addr(s, c), 0)
            memops.write(st, addr(s, c), 0)

    def memset_per_source(st):
        for s in range(1, sources + 1):
            memops.fill(st, addr(s, 0), 0, chunks * 8)

    def copies_per_source(st):
        for s in range(1, sources + 1):
            memops.copy(st, addr(s, chunks), one.data_ptr(), 8)

    def torch_fill(st):
        words[1:sources + 1, :chunks].zero_()

    def block_wait(st):  # the all-gather's one wait for every chunk (on words already set: 0 >= 0)
        memops.wait_block_kernel(st, words.view(-1), words.stride(0), (1, sources + 1), (0, chunks), -1, 0)

    return {"empty": lambda st: None, f"{len(flags)} write-values": writes, f"{len(flags)} waits (set)": waits,
            f"{len(flags)} wait + write": wait_and_write, f"{sources} memsets of {chunks} words": memset_per_source,
            f"{sources} 8-byte copies": copies_per_source, "1 torch fill (kernel)": torch_fill,
            f"1 block wait of {len(flags)} words (set)": block_wait}


def main(argv=None) -> None:
    from cco import layout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", type=int, default=7, help="peers whose flags a call consumes (W - 1)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--reps", type=int, default=10, help="sequences per captured graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays per pass")
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.chunks <= layout.MAX_CHUNKS - 1 or args.sources < 1:
        raise SystemExit(f"probe_stream_ops: --chunks must be 1..{layout.MAX_CHUNKS - 1}, --sources >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("probe_stream_ops: needs a CUDA GPU")
    dev = torch.device("cuda")
    words = torch.zeros(args.sources + 1, layout.MAX_CHUNKS, dtype=torch.int64, device=dev)
    one = torch.ones(1, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream()
    graphs = {}
    for name, fn in arms(words, one, sources=args.sources, chunks=args.chunks).items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn(stream.cuda_stream)  # once outside the capture (loads what the first call loads)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.reps):
                    fn(stream.cuda_stream)
        graphs[name] = graph
    torch.cuda.synchronize()
    per_pass = {name: [] for name in graphs}
    for _ in range(args.passes):
        for name, graph in graphs.items():  # arms in turn within each pass
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            per_pass[name].append(start.elapsed_time(end) * 1e3 / (args.replays * args.reps))
    print(f"{torch.cuda.get_device_name()}: us of device time per sequence, median over {args.passes} passes "
          f"(range); lower is better")
    for name, us in per_pass.items():
        print(f"  {name:28s} {statistics.median(us):8.2f}  ({min(us):.2f} .. {max(us):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "us_per_sequence": per_pass}, f, indent=1)


if __name__ == "__main__":
    main()
