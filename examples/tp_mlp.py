"""A tensor-parallel transformer MLP block through cco, checked against the unfused model.

    python -m examples.tp_mlp                                         # 2 CPU ranks, spawned here
    torchrun --nproc-per-node 2 -m examples.tp_mlp                    # CPU ranks under torchrun
    torchrun --nproc-per-node 2 -m examples.tp_mlp --device cuda      # one GPU per rank (or shared)
    torchrun --nproc-per-node 4 -m examples.tp_mlp --tp 2             # TP 2 x DP 2
    python -m examples.tp_mlp --compile on --train                    # compiled, with a backward
    python -m examples.tp_mlp --sequence-parallel --train             # tokens split over the TP ranks

The block, hidden size H, intermediate size I, tensor parallel over TP ranks::

    h = silu(x @ W_gate.T) * (x @ W_up.T)     # column parallel: each rank holds I/TP rows of W_gate
                                              # and W_up and computes its I/TP columns of h, no comm
    y = all_reduce(h_r @ W_down_r.T)          # row parallel: each rank holds the matching I/TP
                                              # columns of W_down; cco.nn.RowParallelLinear fuses
                                              # the fp8 GEMM with the all-reduce

With ``--sequence-parallel`` (Megatron's sequence parallelism) each TP rank keeps only its block
of tokens between the layers, rank r rows r*M/W..(r+1)*M/W of the flattened ``[M, H]`` activations::

    h = silu(all_gather(x_r) @ W_gate.T) * (...)   # cco.nn.ColumnParallelLinear(sequence_parallel=True):
                                                  # the fp8 rows gathered into the GEMM as they land
    y_r = reduce_scatter(h_r @ W_down_r.T)        # cco.nn.RowParallelLinear(sequence_parallel=True)

and the backward runs the dual collectives (reduce-scatter of grad_x, all-gather of grad_y).

Every rank builds the full weights from one seed (a real job loads its shard), keeps its shard,
and checks ``y`` against the unfused model: the same block with full bf16 matrices on one rank.
The fp8 down projection puts the two a few percent apart (``FP8_TOL``); the same block with the
down projection's operands quantized as the layer quantizes them must agree to bf16 rounding
(``EXACT_TOL``). ``--compile both`` (the default) runs the block eager and under
``torch.compile(fullgraph=True)``. With ``--tp`` smaller than the world the ranks form TP groups
(``torch.distributed.new_group``) and DP replicas that each get their own batch, as in a training
job; the layer takes the TP group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cco import layout
from cco import quant as Q
from cco.nn import ColumnParallelLinear, RowParallelLinear

FP8_TOL = 0.08  # rel. L2 against the bf16 model: fp8 operands (e4m3: 3 mantissa bits)
# --sequence-parallel: gate/up run in fp8 too, two fp8 GEMMs in series; measured at the defaults
# (ptpc, world 2): y 6.4e-2, down grad 8.2e-2, gate/up grad 6.9e-2. A rank that computed on another
# rank's tokens, or a gradient missing a rank's share, is off by ~1
FP8_TOL_SP = 0.12
EXACT_TOL = 1e-2  # rel. L2 against the same quantized operands: bf16 rounding of h and y


class TPMLP(torch.nn.Module):
    """The MLP block of one rank: column-parallel gate/up in bf16, row-parallel down through cco."""

    def __init__(self, hidden: int, intermediate: int, *, tp_group, tp: int, quant: str, m_max: int, device,
                 trainable: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.shard = intermediate // tp
        if sequence_parallel:  # the input is this rank's tokens: the gather is fused into the fp8 GEMM
            self.gate_up = ColumnParallelLinear(hidden, 2 * self.shard, group=tp_group, quant=quant, m_max=m_max,
                                                sequence_parallel=True, trainable=trainable)
        else:
            self.gate_up = torch.nn.Linear(hidden, 2 * self.shard, bias=False, dtype=torch.bfloat16, device=device)
        self.down = RowParallelLinear(self.shard, hidden, group=tp_group, quant=quant, m_max=m_max, trainable=trainable,
                                      sequence_parallel=sequence_parallel)

    def load(self, w_gate, w_up, w_down, tp_rank: int) -> None:
        cols = slice(tp_rank * self.shard, (tp_rank + 1) * self.shard)
        gate_up = torch.cat([w_gate[cols], w_up[cols]])
        if isinstance(self.gate_up, ColumnParallelLinear):
            self.gate_up.load_weight(gate_up)
        else:
            with torch.no_grad():
                self.gate_up.weight.copy_(gate_up)
        self.down.load_weight(w_down[:, cols])

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def full_weights(hidden: int, intermediate: int, seed: int = 0):
    """bf16 (W_gate, W_up, W_down), as a checkpoint holds them."""
    g = torch.Generator().manual_seed(seed)
    scale = hidden ** -0.5
    return tuple(w.to(torch.bfloat16) for w in (
        torch.randn(intermediate, hidden, generator=g) * scale, torch.randn(intermediate, hidden, generator=g) * scale,
        torch.randn(hidden, intermediate, generator=g) * intermediate ** -0.5))


def unfused_model(x, w_gate, w_up, w_down):
    """The block on one rank with the full bf16 weights."""
    bf = torch.bfloat16
    h = F.silu(x @ w_gate.to(bf).t()) * (x @ w_up.to(bf).t())
    return h @ w_down.to(bf).t()


def unfused_grads(x, w_gate, w_up, w_down, *, tp_rank: int, tp: int):
    """This rank's shards of the unfused model's weight gradients for ``mean(y**2)``: (W_down's
    columns, W_gate's and W_up's rows, stacked as the block's gate_up weight)."""
    ws = [w.to(torch.bfloat16).requires_grad_(True) for w in (w_gate, w_up, w_down)]
    unfused_model(x, *ws).float().square().mean().backward()
    shard = w_down.shape[1] // tp
    cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
    return ws[2].grad[:, cols].float(), torch.cat([ws[0].grad[cols], ws[1].grad[cols]]).float()


def quantized_down(x, w_gate, w_up, w_down, *, tp: int, quant: str):
    """The block with the down projection's operands quantized per rank slice as the layer does
    (zero padding to whole 128-wide K tiles, fp8 per ``quant``), partial products in fp32 rounded
    to bf16 and summed in fp32: the layer's arithmetic without its kernels."""
    bf = torch.bfloat16
    h = (F.silu(x @ w_gate.to(bf).t()) * (x @ w_up.to(bf).t())).reshape(-1, w_down.shape[1])
    n, shard = w_down.shape[0], w_down.shape[1] // tp
    k, n_padded = layout.padded_k(shard), layout.padded_n(n, 1, quant=quant)
    total = 0
    for r in range(tp):
        cols = slice(r * shard, (r + 1) * shard)
        a, a_s = Q.quantize_a(F.pad(h[:, cols].float(), (0, k - shard)), quant)
        b, b_s = Q.quantize_b(F.pad(w_down[:, cols].float(), (0, k - shard, 0, n_padded - n)), quant)
        total = total + Q.reference_gemm(a, b, a_s, b_s, quant).float()
    return total.to(bf)[:, :n].reshape(*x.shape[:-1], n)


def run(opts, device) -> dict:
    """One rank's run (torch.distributed initialized); returns its errors per arm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = _check_tp(opts.tp, world)
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]  # every rank makes every group
    tp_group, tp_rank, replica = groups[rank // tp], rank % tp, rank // tp
    w_gate, w_up, w_down = full_weights(opts.hidden, opts.intermediate)
    sp = opts.sequence_parallel
    block = TPMLP(opts.hidden, opts.intermediate, tp_group=tp_group, tp=tp, quant=opts.quant, m_max=opts.m_max,
                  device=device, trainable=opts.train, sequence_parallel=sp)
    block.load(w_gate.to(device), w_up.to(device), w_down.to(device), tp_rank)
    g = torch.Generator().manual_seed(100 + replica)  # each DP replica its own batch
    x = torch.randn(opts.batch, opts.seq, opts.hidden, generator=g).to(torch.bfloat16)
    ref = unfused_model(x, w_gate, w_up, w_down)
    ref_q = quantized_down(x, w_gate, w_up, w_down, tp=tp, quant=opts.quant)
    tokens = x.numel() // opts.hidden
    grads = unfused_grads(x, w_gate, w_up, w_down, tp_rank=tp_rank, tp=tp) if opts.train else None
    if sp:  # this rank's block of the flattened tokens, in and out (a multiple of TP: _check_tp)
        mine = slice(tp_rank * tokens // tp, (tp_rank + 1) * tokens // tp)
        x, ref = x.reshape(tokens, -1)[mine], ref.reshape(tokens, -1)[mine]
    arms = {"eager": block, "compiled": torch.compile(block, fullgraph=True, mode=opts.compile_mode)}
    arms = {name: fn for name, fn in arms.items() if opts.compile in ("both", "on" if name == "compiled" else "off")}
    result = {"repr": repr(block.down), "tp": tp, "arms": {}}
    if sp:  # the column layer's path too: fused, or unfused and why
        result["gate_up repr"] = repr(block.gate_up)
    for name, fn in arms.items():
        block.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(opts.train):
            fn(x.to(device))
            y = fn(x.to(device))  # a compiled function's second call runs the compiled code
        errors = {"y vs unfused bf16 model": Q.rel_l2(y.detach().cpu(), ref)}
        if name == "eager" and not sp:  # inductor computes silu(g) * u in fp32 in one kernel: h rounds
            # differently; sequence parallel: gate/up run in fp8 too, which quantized_down does not model
            errors["y vs quantized unfused"] = Q.rel_l2(y.detach().cpu(), ref_q)
        if opts.train:
            # mean(y**2) over every token: with sequence parallelism each rank holds its tokens' share
            # of the sum, and the backward's collectives add up the ranks' contributions
            (y.float().square().sum() / (tokens * opts.hidden)).backward()
            errors["down grad vs unfused"] = Q.rel_l2(block.down.weight.grad.cpu(), grads[0])
            errors["gate/up grad vs unfused"] = Q.rel_l2(block.gate_up.weight.grad.cpu(), grads[1])
        result["arms"][name] = errors
    block.down.close()
    if sp:
        block.gate_up.close()
        result["sequence_parallel"] = True
    return result


def report(results: list[dict], opts) -> bool:
    r0 = results[0]
    print(f"tp_mlp: hidden {opts.hidden}, intermediate {opts.intermediate}, tokens {opts.batch}x{opts.seq}, "
          f"quant={opts.quant}, world {len(results)}, TP {r0['tp']}"
          + (", sequence parallel" if r0.get("sequence_parallel") else ""))
    print(f"  rank 0 down projection: {r0['repr']}")
    if "gate_up repr" in r0:
        print(f"  rank 0 gate/up projection: {r0['gate_up repr']}")
    ok = True
    for name in r0["arms"]:
        for what in r0["arms"][name]:
            worst = max(r["arms"][name][what] for r in results)
            tol = EXACT_TOL if what == "y vs quantized unfused" else FP8_TOL_SP if r0.get("sequence_parallel") \
                else FP8_TOL
            good = worst <= tol
            ok &= good
            print(f"  {name:8s} {what:24s} rel L2 {worst:.2e} (worst rank, tol {tol:g}) -> {'ok' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.tp_mlp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="hidden size H")
    p.add_argument("--intermediate", type=int, default=1536, help="intermediate size I (split over the TP ranks)")
    p.add_argument("--batch", type=int, default=2, help="sequences per DP replica")
    p.add_argument("--seq", type=int, default=24, help="tokens per sequence")
    p.add_argument("--quant", choices=Q.QUANTS, default="ptpc", help="fp8 format of the cco layers")
    p.add_argument("--m-max", type=int, default=256, help="tokens one fused call takes (sizes the window)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size; None: the whole world")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: start the ranks with torchrun")
    p.add_argument("--compile", choices=("off", "on", "both"), default="both",
                   help="run the block eager (off), under torch.compile(fullgraph=True) (on), or both")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--train", action="store_true", help="trainable weights: also run a backward and check this "
                   "rank's gate/up and down weight gradients against the unfused model's (with --sequence-parallel "
                   "the backward runs the dual collectives: reduce-scatter of grad_x, all-gather of grad_y)")
    p.add_argument("--sequence-parallel", action="store_true", help="keep each TP rank's block of tokens between "
                   "the layers: ColumnParallelLinear(sequence_parallel=True) fuses the all-gather into gate/up, "
                   "RowParallelLinear(sequence_parallel=True) ends in a reduce-scatter")
    opts = p.parse_args(argv)
    for name in ("hidden", "intermediate", "batch", "seq", "m_max", "world"):  # an empty block checks nothing
        if getattr(opts, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(opts, name)} must be >= 1")
    return opts


def _check_tp(tp: int | None, world: int, opts=None) -> int:
    """The TP size (default: the whole world), a divisor of ``world``; with ``opts``, the sequence
    parallel block's tokens split over it. Checked before any rank starts (a rank's SystemExit
    would show as every rank's traceback)."""
    tp = world if tp is None else tp
    if tp < 1 or world % tp:
        raise SystemExit(f"--tp={tp} must be a positive divisor of the world ({world} ranks)")
    if opts is not None and opts.sequence_parallel:
        tokens = opts.batch * opts.seq
        if tokens % tp:
            raise SystemExit(f"--sequence-parallel: --batch x --seq = {tokens} tokens must be a multiple of TP={tp} "
                             f"(each TP rank keeps its block of them)")
        if tokens > opts.m_max:  # the layers' own check would raise on every rank, with every rank's traceback
            raise SystemExit(f"--sequence-parallel: --m-max={opts.m_max} is below the block's {tokens} tokens "
                             f"(--batch x --seq); a sequence-parallel call is never split: pass --m-max >= {tokens}")
    return tp


def _started(opts, world: int) -> None:
    """One line before the ranks build, compile and check (tens of seconds on CPU ranks)."""
    arms = {"both": "eager and compiled", "on": "compiled", "off": "eager"}[opts.compile]
    print(f"tp_mlp: {world} {opts.device.upper()} ranks: building the block, running it {arms}"
          f"{' with a backward' if opts.train else ''} and checking it (CPU ranks: ~20 s)...", flush=True)


def _rank_main(comm, opts):
    """A spawned rank: cco.comm.spawn has initialized torch.distributed for the world."""
    return run(opts, comm.device)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        _check_tp(opts.tp, int(os.environ["WORLD_SIZE"]), opts)  # every rank alike, before the group forms
        local = int(os.environ.get("LOCAL_RANK", 0))
        if opts.device == "cuda":
            device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group("gloo" if opts.device == "cpu" else "cpu:gloo,cuda:nccl")
        if dist.get_rank() == 0:
            _started(opts, dist.get_world_size())
        result = run(opts, device)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        ok = report(results, opts) if dist.get_rank() == 0 else True
        box = [ok]
        dist.broadcast_object_list(box, src=0)
        dist.destroy_process_group()
        return 0 if box[0] else 1
    if opts.device == "cuda":
        raise SystemExit("--device cuda: start the ranks with torchrun (one GPU per local rank, or ranks sharing one)")
    from cco.comm import check_outcomes, spawn

    _check_tp(opts.tp, opts.world, opts)  # before any rank starts
    _started(opts, opts.world)
    results = check_outcomes(spawn(_rank_main, world=opts.world, args=(opts,), timeout_s=900))
    return 0 if report(results, opts) else 1


if __name__ == "__main__":
    sys.exit(main())
