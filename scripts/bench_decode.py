"""Decode speed: a Llama model's greedy decode with cco layers against bf16 ``nn.Linear``, and the
per-call table of the row-parallel shapes at decode sizes.

    python3 -m scripts.bench_decode --json decode.json --plot decode.png          # one GPU, world 1
    torchrun --nproc-per-node 2 -m scripts.bench_decode --per-call-only --json w2.json   # host cost, world W

World 1, the model (``--layers``, ``--hidden``, ``--intermediate``; default Llama-3-8B's dims, 8
layers, random weights): transformers' ``LlamaForCausalLM`` in bf16 with a static KV cache, a prompt
of ``--prompt`` tokens per sequence, then ``--tokens`` greedy decode steps, batch 1 and 8. One decode
step is ``model(ids, cache_position)`` -> argmax -> the next ids, written in place, so the same step
runs eager (``eager``) and as a replay of a CUDA graph captured from it (``graph``). Arms: ``bf16``
(the model as built), ``cco <quant>`` (every ``o_proj`` and ``down_proj`` replaced by
``cco.nn.RowParallelLinear`` at world 1, the layers transformers marks "rowwise"), ``cco <quant>,
every linear`` (also every ``q/k/v_proj`` and ``gate/up_proj`` replaced by ``cco.nn.ColumnParallelLinear``:
the whole decoder's weights in fp8, the lm_head bf16), and ``fp8 unfused
<quant>`` (the same layers as a model runs fp8 today without cco: ``cco.quant.quantize_a`` in torch,
then ``torch._scaled_mm``; cuBLAS's blockwise recipe refuses M % 4 != 0, so blockscale's rows are
padded with zero rows to a multiple of 4 there, as the cco layer pads them). Per arm and mode: ms/token over ``--repeats`` decodes of ``--tokens`` tokens from
the same prefilled cache (``cco.bench.timing.time_back_to_back``, one decode per pass, the arms
alternating per pass in rotated order, so a drift of the clocks over the run lands on every arm):
median and min..max, and each pass's time over bf16's in the same pass (``vs_bf16``: the arms of a
pass run back to back, so a host that drifts over the run divides out); eagerly also the issuing
thread's CPU time per token (mode ``eager thread CPU``: what the step costs the host itself, less
the time a busy host kept the thread off the CPU); the first decode step's logits against the bf16
arm's (relative L2); and whether the captured step decodes the tokens the eager steps decode.
``--from RUN.json`` prints an earlier run's table (``--plot``: its picture) with no GPU.

Per call (``--shapes``, M in ``-m``): the ``o_proj`` and ``down_proj`` shapes of Llama-3-8B and -70B
at TP 1, 2 and 8 (N = hidden, K = the rank's slice). Arms: ``nn.Linear`` bf16 ``[N, K]``, and per
quant the layer, its activation quantizer alone, its op alone (on pre-quantized operands) and, where
the layer runs the decode GEMM (M <= ``decode_rows``), the two launches it replaces (quantizer + op). Eager:
``time_back_to_back`` (host us/call and wall us/call); device: CUDA-graph replays of ``--graph-calls``
calls per graph (``time_arms``), divided by the calls, every call on the same weight; with
``--cold`` also, in the same passes, a graph whose calls are each on their own weight
(``--graph-calls`` weights per shape, as a model's layers follow each other: a weight that fits the
L2 cache, 8B o_proj's, is not re-read from it by the next call; ``graph_us_cold``).
World W (torchrun; ranks may share a GPU: then the host times are real and the device times are
time-sliced) runs the per-call table eager only.

``--profile``: a cProfile of ``--profile-calls`` eager calls at the first shape, per quant and M:
the layer (its rule's path), ``nn.Linear``, and once ``torch.ops.cco.row_parallel_linear``; the top
functions by own time, then the project's own by cumulative time, written beside the JSON
(``<json>_profile.txt``; ``bench_decode_profile.txt`` without ``--json``: rank 0's, every rank calling);
with the model (world 1), also ``--tokens`` eager decode steps per arm at the first batch
(``<json>_model_profile.txt``, ``profile_model``); ``--model-only`` profiles the model alone.
``--jit-arms``: the per-call table's layer and op of each quant also with the kept launches off
(``slow_launches``), in the same passes: what the kept launches save, at any world.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if not __package__:  # run by path (python3 scripts/bench_decode.py): the repository root, which -m puts on
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # sys.path, holds scripts.*

import torch

from cco import quant as Q
from scripts._cli import DefaultsHelp, ints

# (model, hidden, intermediate): the two models whose row-parallel shapes the per-call table takes
MODELS = {"8b": (4096, 14336), "70b": (8192, 28672)}
TPS = (1, 2, 8)


def _quants(text: str) -> list[str]:
    quants = [q for q in text.split(",") if q]
    bad = [q for q in quants if q not in Q.QUANTS]
    if bad or not quants:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: pick from {', '.join(Q.QUANTS)}")
    return quants


SIZES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "prompt", "tokens", "repeats",
         "graph_calls", "calls", "profile_calls")  # each >= 1


PROFILE_STEM = "bench_decode"  # --profile's files without --json: bench_decode_profile.txt, ..._model_profile.txt


def profile_path(args, what: str) -> str:
    """Where ``--profile`` writes its ``what`` tables ("profile", "model_profile"): beside ``--json``
    (``<json>_<what>.txt``), else ``bench_decode_<what>.txt`` in the working directory."""
    return f"{os.path.splitext(args.json)[0] if args.json else PROFILE_STEM}_{what}.txt"


def parse_args(argv=None):
    # the comma-list options' defaults are strings, as the user types them (--help shows "1,8", not "[1, 8]"):
    # argparse runs a string default through type=, so args holds the parsed list either way
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                                formatter_class=DefaultsHelp)
    p.add_argument("--layers", type=int, default=8, help="the model: decoder layers")
    p.add_argument("--hidden", type=int, default=4096, help="the model: hidden size")
    p.add_argument("--intermediate", type=int, default=14336, help="the model: MLP intermediate size")
    p.add_argument("--heads", type=int, default=32, help="the model: attention heads")
    p.add_argument("--kv-heads", type=int, default=8, help="the model: key/value heads")
    p.add_argument("--vocab", type=int, default=128256, help="the model: vocabulary size")
    p.add_argument("--batch", type=ints, default="1,8", help="the model: comma list of batch sizes")
    p.add_argument("--prompt", type=int, default=16, help="the model: prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=64, help="the model: greedy decode steps per timed decode")
    p.add_argument("--repeats", type=int, default=5, help="the model: timed decodes per arm and mode")
    p.add_argument("--quant", type=_quants, default=",".join(Q.QUANTS), help="comma list of " + ", ".join(Q.QUANTS))
    p.add_argument("-m", type=ints, default="1,8,64,256", help="per-call table: comma list of row counts")
    p.add_argument("--shapes", default="all",
                   help=f"per-call table: all, or a comma list of {', '.join(shapes('all'))}")
    p.add_argument("--graph-calls", type=int, default=10, help="per-call table: calls per captured CUDA graph")
    p.add_argument("--calls", type=int, default=50, help="per-call table: eager calls per arm and pass")
    p.add_argument("--passes", type=int, default=3, help="per-call table: timing passes (>= 3)")
    p.add_argument("--cold", action="store_true",
                   help="per-call table, world 1: each arm also timed as a graph whose --graph-calls calls are each "
                        "on its own weight (as a model's layers follow each other: no call finds its weight in L2 "
                        "from the call before), in the same passes as the one-weight graphs (graph_us_cold)")
    p.add_argument("--per-call-only", action="store_true", help="the per-call table alone, no model")
    p.add_argument("--model-only", action="store_true", help="the model alone, no per-call table")
    p.add_argument("--jit-arms", action="store_true",
                   help="per-call table: each quant's layer and op also with the kept launches off (every Triton "
                        "launch through JITFunction.run), eager only, in the same passes")
    p.add_argument("--python-arms", action="store_true",
                   help="each cco arm also with the decode GEMM's C++ call path off (kernels_fused.hopper.native: "
                        "the Python path's kept launches), eager only, in the same passes")
    p.add_argument("--kept-arms", "--lt-arms", dest="kept_arms", action="store_true",
                   help="each cco arm of a quant whose rows take the C++ table's kept vendor call (blockscale's "
                        "cuBLASLt call with CCO_DECODE_BLOCKSCALE_CUBLAS=1, mxfp8's cublasGemmEx) also with it off "
                        "(decode.KEPT_CALL: torch's at::_scaled_mm / at::mm), eager only, in the same passes")
    p.add_argument("--profile", action="store_true",
                   help="cProfile of eager calls at the first shape into <json>_profile.txt and, with the model, "
                        "of eager decode steps into "
                        "<json>_model_profile.txt; without --json into bench_decode_profile.txt and "
                        "bench_decode_model_profile.txt")
    p.add_argument("--profile-calls", type=int, default=200, help="--profile: eager calls profiled per arm")
    p.add_argument("--json", help="write the results here (after every section and shape)")
    p.add_argument("--plot", help="a PNG of the model's ms/token per arm")
    p.add_argument("--plot-per-call", help="a PNG of the per-call table: each quant's host and device time "
                                           "against nn.Linear's over M, per shape, with the targets")
    p.add_argument("--from", dest="from_json", help="a --json of an earlier run (no GPU): print its model's table "
                                                    "with each arm's ratio to bf16 pass by pass, or draw --plot / "
                                                    "--plot-per-call from it")
    p.add_argument("--smoke", action="store_true", help="CPU: run every arm's decode step once, tiny model, no timing")
    args = p.parse_args(argv)
    small = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in SIZES if getattr(args, name) < 1]
    if small:
        p.error(f"{', '.join(small)}: must be >= 1")
    if args.passes < 3:
        p.error(f"--passes {args.passes}: >= 3 (a spread needs them)")
    if args.model_only and args.per_call_only:
        p.error("--model-only and --per-call-only: each leaves out what the other runs; pass one (neither: both)")
    if args.plot and args.per_call_only:
        p.error("--plot draws the model's ms/token, --per-call-only runs no model: use --plot-per-call")
    if args.plot_per_call and args.model_only:
        p.error("--plot-per-call draws the per-call table, --model-only runs none: use --plot")
    if args.profile and args.smoke:
        p.error("--profile times calls on the GPU, --smoke runs each arm once on the CPU: pass one or the other")
    if args.smoke and (args.plot or args.plot_per_call):  # (its records have no times: empty axes)
        p.error(f"{'--plot' if args.plot else '--plot-per-call'} draws times, --smoke times nothing: pass one or "
                f"the other")
    if args.smoke and args.per_call_only:  # (the smoke runs the model only: nothing would run)
        p.error("--smoke runs the model's arms, --per-call-only leaves the model out: pass one or the other")
    # torchrun's world (launched_or_one_rank's): the model and nn.Linear's per-call arm run at world 1 only
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1
    if world > 1 and not args.from_json and (args.smoke or args.model_only):
        p.error(f"{'--smoke' if args.smoke else '--model-only'} runs the model, which runs at world 1 only (world "
                f"{world} here): run it without torchrun")
    if world > 1 and args.cold:
        p.error(f"--cold times graph replays, which world 1 alone runs (world {world} here): run it without torchrun")
    if world > 1 and not args.from_json and (args.plot or args.plot_per_call):
        p.error(f"{'--plot' if args.plot else '--plot-per-call'} draws against world 1's arms (the model, "
                f"nn.Linear), world {world} runs neither: run it at world 1, or pass --json and draw another "
                f"run's with --from")
    try:  # (a bad name found at parse time, not after the model's section has run)
        shapes(args.shapes)
    except SystemExit as err:
        p.error(str(err).removeprefix("bench_decode: "))
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, args, ("json", "plot", "plot_per_call"))
    for flag in ("plot", "plot_per_call"):
        if getattr(args, flag):  # (a suffix matplotlib cannot write would raise only after the run)
            from scripts.plot_results import check_plot_path

            check_plot_path(p, f"--{flag.replace('_', '-')}", getattr(args, flag))
    return args


def shapes(selection: str) -> dict[str, tuple[int, int]]:
    """``{name: (N, K)}``: o_proj (K = hidden / TP) and down_proj (K = intermediate / TP) per model and TP."""
    out = {}
    for model, (hidden, inter) in MODELS.items():
        for tp in TPS:
            out[f"{model}-o-tp{tp}"] = (hidden, hidden // tp)
            out[f"{model}-down-tp{tp}"] = (hidden, inter // tp)
    if selection == "all":
        return out
    names = selection.split(",")
    missing = [n for n in names if n not in out]
    if missing:
        raise SystemExit(f"bench_decode: --shapes {missing} unknown; pick from {', '.join(out)}")
    return {n: out[n] for n in names}


# --------------------------------------------------------------------------------------------------
# arms
# --------------------------------------------------------------------------------------------------
class UnfusedFp8Linear(torch.nn.Module):
    """An fp8 linear as a model runs it without cco: ``quantize_a`` (torch) then ``torch._scaled_mm``
    (blockscale: the rows padded with zero rows to cuBLAS's multiple, which its blockwise recipe
    needs, and the call's rows taken back)."""

    def __init__(self, linear: torch.nn.Linear, quant: str):
        super().__init__()
        from cco.bench.timing import cublas_gemm

        self.quant, self.k = quant, linear.in_features
        b, b_scale = Q.quantize_b(linear.weight.detach().float(), quant)
        self.gemm, why = cublas_gemm(quant, b, b_scale)
        if self.gemm is None:
            raise ValueError(why)

    def forward(self, x):
        from kernels_fused.hopper.vendor import padded_rows

        rows = x.reshape(-1, self.k)
        m = rows.shape[0]
        rows = torch.nn.functional.pad(rows, (0, 0, 0, padded_rows(self.quant, m) - m))
        a, a_scale = Q.quantize_a(rows, quant=self.quant)
        return self.gemm(a, a_scale)[:m].view(*x.shape[:-1], -1)


def cco_layer(linear: torch.nn.Linear, quant: str, comm, m_max: int):
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(linear.in_features, linear.out_features, group=comm, quant=quant, m_max=m_max)
    layer.load_weight(linear.weight.detach())
    return layer


def cco_column_layer(linear: torch.nn.Linear, quant: str, comm, m_max: int):
    from cco.nn import ColumnParallelLinear

    layer = ColumnParallelLinear(linear.in_features, linear.out_features, group=comm, quant=quant, m_max=m_max)
    layer.load_weight(linear.weight.detach())
    return layer


def rowwise(model):
    """``[(parent, attribute, nn.Linear)]``: the o_proj and down_proj of every decoder layer."""
    out = []
    for block in model.model.layers:
        out.append((block.self_attn, "o_proj", block.self_attn.o_proj))
        out.append((block.mlp, "down_proj", block.mlp.down_proj))
    return out


def colwise(model):
    """``[(parent, attribute, nn.Linear)]``: the q/k/v_proj and gate/up_proj of every decoder layer."""
    out = []
    for block in model.model.layers:
        out += [(block.self_attn, name, getattr(block.self_attn, name)) for name in ("q_proj", "k_proj", "v_proj")]
        out += [(block.mlp, name, getattr(block.mlp, name)) for name in ("gate_proj", "up_proj")]
    return out


def swapped(model, make, make_column=None):
    """Replace every row-wise linear by ``make(linear)`` and, with ``make_column``, every column-wise
    one by ``make_column(linear)`` (``make`` None: put the originals back); returns the modules now in
    every row-wise, then every column-wise slot (:func:`place` puts them back)."""
    modules = [linear if make is None or maker is None else maker(linear)
               for linears, maker in ((model._cco_rowwise, make), (model._cco_colwise, make_column))
               for _, _, linear in linears]
    place(model, modules)
    return modules


def place(model, modules: list) -> None:
    """Put ``modules`` (what :func:`swapped` returned) into every row-wise, then every column-wise slot."""
    for (parent, name, _), module in zip(model._cco_rowwise + model._cco_colwise, modules, strict=True):
        setattr(parent, name, module)


# --------------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------------
def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model._cco_rowwise, model._cco_colwise = rowwise(model), colwise(model)
    return model


class Decoder:
    """One batch's decode state: a static cache prefilled with a prompt, and the in-place step."""

    def __init__(self, model, batch: int, prompt: int, tokens: int, device):
        from transformers import StaticCache

        self.model, self.batch, self.prompt = model, batch, prompt
        self.cache = StaticCache(config=model.config, max_cache_len=prompt + tokens + 8)
        g = torch.Generator().manual_seed(batch)
        self.prompt_ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g).to(device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.first_logits = None  # the prefill's last position: the same input in every arm

    @torch.no_grad()
    def prefill(self):
        """Fill the cache with the prompt (eager); the step state at the first decode position."""
        self.cache.reset()
        cache_position = torch.arange(self.prompt, device=self.ids.device)
        out = self.model(input_ids=self.prompt_ids, cache_position=cache_position, past_key_values=self.cache,
                         use_cache=True)
        self.first_logits = out.logits[:, -1]
        self.ids.copy_(self.first_logits.argmax(-1, keepdim=True))
        self.pos.fill_(self.prompt)

    def mark(self):
        """Keep the step state to come back to (:meth:`rewind`): the next ids, the position, and the
        lengths transformers' static cache counts itself (a device tensor per layer)."""
        self._marked = (self.ids.clone(), self.pos.clone(),
                        [(layer.cumulative_length, layer.cumulative_length.clone()) for layer in self.cache.layers])

    def rewind(self):
        """Back to the state :meth:`mark` kept (the cache entries after it are overwritten as the
        steps run again)."""
        ids, pos, lengths = self._marked
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        for length, start in lengths:
            length.copy_(start)

    def capture(self) -> "torch.cuda.CUDAGraph":
        """One step captured into a CUDA graph (three warm steps on a side stream first, as a capture
        wants), the state rewound: each replay is one step on the same buffers."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.rewind()
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        torch.cuda.synchronize()
        self.rewind()
        return graph

    @torch.no_grad()
    def step(self):
        out = self.model(input_ids=self.ids, position_ids=self.pos.view(1, 1).expand(self.batch, 1),
                         cache_position=self.pos, past_key_values=self.cache, use_cache=True)
        self.last_logits = out.logits[:, -1]
        self.ids.copy_(self.last_logits.argmax(-1, keepdim=True))
        self.pos.add_(1)


def model_runs(args, comm, device) -> list[dict]:
    """Per batch: every arm built and checked first (the first step's logits against bf16's, a step
    captured in a CUDA graph that decodes the tokens eager decodes), then timed with the arms
    alternating per pass (``time_back_to_back`` rotates their order), eager and then replayed, so a
    drift of the host's or the GPU's clocks over the run lands on every arm alike."""
    from cco.bench.timing import time_back_to_back

    model = build_model(args, device)
    arms = {"bf16": None}
    for q in args.quant:
        arms[f"cco {q}"] = ("cco", q)
    for q in args.quant:
        arms[f"cco {q}, every linear"] = ("cco-all", q)
    for q in ("ptpc", "blockscale"):  # (mxfp8: cuBLAS has no recipe before Blackwell, so no unfused arm)
        if q in args.quant:
            why = unfused_missing(q, device)
            if why is None:
                arms[f"fp8 unfused {q}"] = ("unfused", q)
            else:  # left out as mxfp8's is (a CPU torch has no blockwise _scaled_mm), not a failed arm
                print(f"fp8 unfused {q}: left out: {why}", flush=True)
    runs = []
    for batch in args.batch:
        dec = Decoder(model, batch, args.prompt, args.tokens, device)
        records, built = {}, {}  # arm -> its record; arm -> (its modules, its captured step or None)
        base_logits = None
        for arm, how in arms.items():
            record = records[arm] = {"batch": batch, "arm": arm}
            made = []
            try:
                made = install(model, how, comm, max(256, batch * args.prompt))
                dec.prefill()
                dec.step()
                # the prefill's logits: a decode step's input is the arm's own argmax, which fp8 may change
                logits = dec.first_logits.float()
                if base_logits is None:
                    base_logits = logits
                record["logits_rel_l2_vs_bf16"] = float((logits - base_logits).norm() / base_logits.norm())
                if args.smoke:
                    record["ok"] = bool(torch.isfinite(logits).all())
                    continue
                dec.mark()
                graph = None
                try:
                    graph = dec.capture()
                    record["same_tokens_as_eager"] = same_tokens(dec, graph)
                except Exception as err:  # a step that cannot be captured: eager only
                    torch.cuda.synchronize()
                    record["graph_error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                built[arm] = (made, graph)
                made = []
            except Exception as err:  # one arm's failure (a refused shape) is recorded, not fatal
                record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            finally:
                swapped(model, None)
                close(made)
            progress(f"batch {batch}: {arm} " + (f"failed: {record['error']}" if "error" in record else "built"
                                                  + (", its step captured" if built.get(arm, (0, None))[1] else "")))
        if built and args.profile and batch == args.batch[0]:
            progress(f"batch {batch}: profiling {len(built)} arms")
            profile_model(model, dec, built, args, profile_path(args, "model_profile"))
        if built:
            progress(f"batch {batch}: timing {len(built)} arms, {args.repeats} passes of {args.tokens} tokens, eager "
                     f"then replayed")
            timed = time_decode(model, dec, built, args, time_back_to_back)
            for arm, modes in timed.items():  # a Python-path arm gets a record of its own
                records.setdefault(arm, {"batch": batch, "arm": arm})["modes"] = modes
        pass_ratios(list(records.values()))
        for record in records.values():
            print(model_line(record), flush=True)
            runs.append(record)
        swapped(model, None)
        for made, graph in built.values():
            close(made)
        del dec, built
    return runs


_START = time.monotonic()
CPU_MODE = "eager thread CPU"  # a model arm's mode: the issuing thread's CPU time per token, eager
MODE_COLORS = {"eager": "tab:blue", CPU_MODE: "lightsteelblue", "graph": "tab:orange"}  # (a target's line: its mode's)


def progress(what: str) -> None:
    """A line on stderr (stdout keeps the table): where a long model run is, seconds since the start."""
    print(f"[bench_decode {time.monotonic() - _START:6.0f} s] {what}", file=sys.stderr, flush=True)


def pass_ratios(runs: list) -> None:
    """Give each timed arm's modes ``vs_bf16``: its time over bf16's in the same batch and mode,
    pass by pass (median, min, max). The arms alternate per pass (``time_back_to_back``), so pass
    ``i`` of every arm ran within one round, and a drift of the host's speed over the run (eager
    passes on a lent machine spread by up to 50%) divides out of each pass's ratio, which the
    ratio of two medians over passes keeps. Left out where bf16 has no such mode or other passes."""
    from cco.bench.timing import per_pass_ratio

    base = {r["batch"]: r["modes"] for r in runs if r.get("arm") == "bf16" and isinstance(r.get("modes"), dict)}
    for r in runs:
        ref = base.get(r.get("batch"))
        if r.get("arm") == "bf16" or ref is None:
            continue
        for mode, t in r.get("modes", {}).items():
            b = ref.get(mode, {}).get("passes")
            if b and len(b) == len(t.get("passes", ())):
                t["vs_bf16"] = dict(zip(("median", "min", "max"), per_pass_ratio(t["passes"], b)))


def model_line(record: dict) -> str:
    """One printed line of a model arm: per mode ms/token, median (min..max) over passes, and where
    :func:`pass_ratios` gave it the ratio to bf16 pass by pass (lower is better)."""
    def mode(name, r):
        vs = r.get("vs_bf16")
        return (f"{name} {r['ms_per_token']:.2f} ms/token ({r['min']:.2f}..{r['max']:.2f})"
                + (f" {vs['median']:.2f}x of bf16 ({vs['min']:.2f}..{vs['max']:.2f})" if vs else ""))

    ok = record.get("ok")
    return (f"batch {record['batch']} {record['arm']:22s} "
            + " | ".join(mode(name, r) for name, r in record.get("modes", {}).items())
            + (f" ERROR {record['error']}" if "error" in record else "")
            + (" ok" if ok else " NOT OK: non-finite logits" if ok is False else ""))


def unfused_missing(quant: str, device) -> str | None:
    """Why ``quant``'s unfused arm cannot run here (``cublas_gemm``'s reason: this torch has no
    blockwise ``_scaled_mm`` on ``device``), else None; asked once with a 128x128 weight."""
    from cco.bench.timing import cublas_gemm

    b, b_scale = Q.quantize_b(torch.ones(128, 128, device=device), quant)
    return cublas_gemm(quant, b, b_scale)[1]


def install(model, how, comm, m_max: int) -> list:
    """Put one arm's linears into ``model`` (``how``: None bf16, ``("cco" | "cco-all" | "unfused",
    quant)``); returns the modules made (none for bf16)."""
    if how is None:
        swapped(model, None)
        return []
    if how[0] in ("cco", "cco-all"):
        return swapped(model, lambda lin, q=how[1]: cco_layer(lin, q, comm, m_max=m_max),
                       (lambda lin, q=how[1]: cco_column_layer(lin, q, comm, m_max=m_max)) if how[0] == "cco-all"
                       else None)
    return swapped(model, lambda lin, q=how[1]: UnfusedFp8Linear(lin, q))


def close(made: list) -> None:
    for module in made:
        if hasattr(module, "close"):
            module.close()


def same_tokens(dec, graph) -> bool:
    """Whether four replays of the captured step decode what four eager steps decode from the same state."""
    dec.rewind()
    for _ in range(4):
        graph.replay()
    ids_graph = dec.ids.clone()
    dec.rewind()
    for _ in range(4):
        dec.step()
    return bool(torch.equal(ids_graph, dec.ids))


def time_decode(model, dec, built: dict, args, time_back_to_back) -> dict:
    """ms/token of ``args.tokens`` decode steps per arm, eager and replayed from its captured step,
    the arms alternating per pass. Every arm decodes from the same state: the cache prefilled by
    the last arm built, rewound to its first decode position (the tokens decoded differ by arm, the
    work per step does not)."""
    from kernels_fused.hopper import decode as D

    def eager(model=model, made=None):
        put(model, made)
        dec.rewind()
        for _ in range(args.tokens):
            dec.step()

    steps = {arm: (lambda made=made: eager(made=made)) for arm, (made, _) in built.items()}
    if args.python_arms:
        steps.update({f"{arm} {PY_ARM}": python_path(steps[arm]) for arm in built if arm.startswith("cco")})
    if args.kept_arms:  # (the quants whose rows take the C++ table's kept vendor call)
        steps.update({f"{arm} {KEPT_ARM}": without_kept_call(steps[arm]) for arm in built
                      if arm.startswith("cco") and any(q in arm for q in D.VENDOR_ROWS)})
    t = time_back_to_back(steps, calls=1, passes=args.repeats, warmup=1)
    swapped(model, None)
    out = {}
    for arm, r in t.items():  # (a Python-path arm: eager only, under its own name)
        out[arm] = {"eager": summary(r["wall_pass_us"], args.tokens)}
        out[arm]["eager"]["host_ms_per_token"] = statistics.median(r["host_pass_us"]) / 1e3 / args.tokens
        # the issuing thread's CPU time: what the eager step costs the host itself, less a busy
        # host's time off the CPU (each pass's ratio to bf16's, pass_ratios, as for the wall time)
        out[arm][CPU_MODE] = summary(r["cpu_pass_us"], args.tokens)

    def replays(graph):
        dec.rewind()
        for _ in range(args.tokens):
            graph.replay()

    graphs = {arm: graph for arm, (_, graph) in built.items() if graph is not None}
    if graphs:
        t = time_back_to_back({arm: (lambda graph=graph: replays(graph)) for arm, graph in graphs.items()},
                              calls=1, passes=args.repeats, warmup=1)
        for arm, r in t.items():
            out[arm]["graph"] = summary(r["wall_pass_us"], args.tokens)
    return out


def put(model, made: list) -> None:
    """One built arm's linears into ``model`` (none: bf16, the model's own)."""
    if made:
        place(model, made)
    else:
        swapped(model, None)


def profile_model(model, dec, built: dict, args, path: str) -> None:
    """cProfile of ``--tokens`` eager decode steps per built arm (one batch), after a warm step: host
    us per step under the profiler, then the top functions by own time and the cco layers' entry
    points by cumulative time, written to ``path``: where an eager step's host time goes by arm."""
    import cProfile
    import io
    import pstats

    with open(path, "a") as f:
        for arm, (made, _) in built.items():
            put(model, made)
            dec.rewind()
            dec.step()
            torch.cuda.synchronize()
            dec.rewind()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.tokens):
                dec.step()
            prof.disable()
            spent = (time.perf_counter() - t0) / args.tokens * 1e6
            torch.cuda.synchronize()
            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(r"cco/|kernels_fused/", 15)
            f.write(f"==== batch {dec.batch}, {arm}: {spent:.0f} us/step under the profiler, {args.tokens} steps\n"
                    f"{s.getvalue()}\n")
            print(f"profiled batch {dec.batch} {arm}: {spent:.0f} us/step under the profiler", flush=True)
        swapped(model, None)


def summary(pass_us, tokens: int) -> dict:
    per = [u / 1e3 / tokens for u in pass_us]
    return {"ms_per_token": statistics.median(per), "min": min(per), "max": max(per), "passes": per}


def launched_or_one_rank(device: torch.device):
    """The launcher's communicator (torchrun's ``RANK`` / ``WORLD_SIZE``), else one rank of its own
    on ``device`` (a private file rendezvous)."""
    from cco.comm import Communicator

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return Communicator.from_env()
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    return Communicator(rank=0, world=1, init_method=f"file://{rendezvous}", device=device)


# --------------------------------------------------------------------------------------------------
# per call
# --------------------------------------------------------------------------------------------------
def seeded_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """The decode benchmarks' weight: fp32 ``[n, k]`` on the CPU, unit-variance rows over sqrt(k),
    from ``seed`` (every run times the same weights; ``--cold``'s copies take seeds 1..)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(n, k, generator=g) / k ** 0.5


def seeded_linear(n: int, k: int, device, seed: int = 0) -> torch.nn.Linear:
    """A bf16 ``nn.Linear(k, n)`` without bias over :func:`seeded_weight`."""
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(seeded_weight(n, k, seed).to(device=device, dtype=torch.bfloat16))
    return linear


def per_call_arms(args, x, m: int, linear, layers: dict, world: int) -> dict:
    """The per-call table's arms at ``x`` (``m`` rows) over one weight: ``linear`` and its cco
    ``layers`` per quant (each arm a callable of no argument)."""
    from cco.nn.linear import quantize_activation
    from kernels_fused.hopper import decode as D

    arms = {}
    if world == 1:
        arms["nn.Linear bf16"] = lambda: linear(x)
    for q, layer in layers.items():
        a, a_scale = quantize_activation(x, q, k_padded=layer.k_padded, m_padded=layer._rows_for(m))
        arms[f"cco {q}"] = lambda layer=layer: layer(x)
        arms[f"cco {q}: quantizer"] = (lambda layer=layer, q=q: quantize_activation(
            x, q, k_padded=layer.k_padded, m_padded=layer._rows_for(m)))
        arms[f"cco {q}: op"] = (lambda layer=layer, a=a, s=a_scale: layer.op(a, layer.qweight, s,
                                                                            layer.weight_scale))
        if 0 < m <= layer.decode_rows:  # the layer runs the decode GEMM: the two launches it replaced
            arms[f"cco {q}: quantizer + op"] = (lambda layer=layer, q=q: _two_launches(layer, x, q))
        if args.jit_arms:
            for kept in (f"cco {q}", f"cco {q}: op"):
                arms[f"{kept} {JIT_ARM}"] = slow_launches(arms[kept])
        if args.python_arms:
            arms[f"cco {q} {PY_ARM}"] = python_path(arms[f"cco {q}"])
        if args.kept_arms and q in D.VENDOR_ROWS:
            arms[f"cco {q} {KEPT_ARM}"] = without_kept_call(arms[f"cco {q}"])
    return arms


def per_call_runs(args, comm, device, *, into: list, after_shape=lambda: None) -> list[dict]:
    from cco.bench.timing import time_arms, time_back_to_back

    rows = into
    world = comm.world
    if world == 1 and not args.cold and comm.rank == 0:
        print("bench_decode: the per-call device times are graphs of calls on one weight, which the L2 cache serves "
              "in part where it fits (up to ~50 MB); --cold also times each arm with a weight a call, as a model "
              "reads them", file=sys.stderr, flush=True)
    for name, (n, k) in shapes(args.shapes).items():
        linear = seeded_linear(n, k, device)
        layers = {q: cco_layer(linear, q, comm, m_max=max(args.m)) for q in args.quant}
        # --cold: the graphs' calls each on its own weight (seeds 1.. beside the eager arms' seed 0)
        cold = []
        if args.cold and world == 1:
            for seed in range(1, args.graph_calls):
                other = seeded_linear(n, k, device, seed)
                cold.append((other, {q: cco_layer(other, q, comm, m_max=max(args.m)) for q in args.quant}))
        for m in args.m:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            arms = per_call_arms(args, x, m, linear, layers, world)
            record = {"shape": name, "n": n, "k": k, "m": m, "world": world}
            with torch.no_grad():
                if world == 1:  # the layer's output against the bf16 linear's
                    ref = linear(x).float()
                    record["rel_l2_vs_bf16"] = {q: float((layer(x).float() - ref).norm() / ref.norm())
                                                for q, layer in layers.items()}
                gather = comm.all_gather_object if world > 1 else None
                barrier = comm.barrier if world > 1 else None
                eager = time_back_to_back(arms, calls=args.calls, passes=args.passes, barrier=barrier, gather=gather)
                record["eager"] = {a: {"host_us": t["host_us"], "wall_us": t["wall_us"]} for a, t in eager.items()}
                if world == 1:  # (the JITFunction.run and Python-path arms differ on the host only)
                    graph_arms = {a: fn for a, fn in arms.items() if JIT_ARM not in a and PY_ARM not in a
                                  and KEPT_ARM not in a}
                    others = [per_call_arms(args, x, m, lin, lays, world) for lin, lays in cold]
                    record["graph_us"], timed_cold = one_weight_and_cold(
                        graph_arms, others, lambda arms: graph_device_us(arms, args, time_arms))
                    if others:
                        record["graph_us_cold"] = timed_cold
                        record["graph_weights_cold"] = 1 + len(others)
            rows.append(record)
            if comm.rank == 0:
                base = record["eager"].get("nn.Linear bf16")
                line = f"{name:14s} M={m:4d} |"
                for a, t in record["eager"].items():
                    if ":" in a:
                        continue
                    dev = record.get("graph_us", {}).get(a)
                    cold_dev = record.get("graph_us_cold", {}).get(a)
                    rel = f" {t['host_us'] / base['host_us']:.2f}x host" if base and a != "nn.Linear bf16" else ""
                    line += f" {a}: host {t['host_us']:.1f}{rel}, wall {t['wall_us']:.1f}" + (
                        f", graph {dev:.1f}" if dev else "") + (f", cold {cold_dev:.1f}" if cold_dev else "") + " |"
                print(line, flush=True)
        for layer in [*layers.values(), *(lay for _, lays in cold for lay in lays.values())]:
            layer.close()
        after_shape()
    return rows


JIT_ARM = "via JITFunction.run"  # the suffix of --jit-arms' arms
COLD = " [cold]"  # the suffix of --cold's graphs while they are timed
PY_ARM = "via the Python path"  # the suffix of --python-arms' arms
KEPT_ARM = "via torch's op"  # the suffix of --kept-arms' arms


def without_kept_call(fn):
    """``fn`` with the C++ table's kept vendor call off for its call (``decode.KEPT_CALL``): its
    vendor plans call torch's op (``at::_scaled_mm``, ``at::mm``), as the Python path does."""
    from kernels_fused.hopper import decode as D

    return switched_off(fn, D, "KEPT_CALL")


def python_path(fn):
    """``fn`` with the decode GEMM's C++ call path off for its call (``native.ENABLED``)."""
    from kernels_fused.hopper import native as NV

    return switched_off(fn, NV, "ENABLED")


def slow_launches(fn):
    """``fn`` with the kept launches off for its call (``kernels_fused.hopper.launch.FAST_LAUNCH``:
    every Triton launch through ``JITFunction.run``): what a kept launch saves, timed in the same
    passes as ``fn``. At world >= 2 every rank switches alike (the calls are collective)."""
    from kernels_fused.hopper import launch as L

    return switched_off(fn, L, "FAST_LAUNCH")


def switched_off(fn, module, flag: str):
    """``fn`` with the boolean ``module.flag`` False for its call, True again after it (raised or
    not): one arm of a same-pass comparison of a switch the module reads per call."""
    def arm():
        setattr(module, flag, False)
        try:
            return fn()
        finally:
            setattr(module, flag, True)
    return arm


def _two_launches(layer, x, quant):
    """What the layer ran before the decode GEMM at these rows: the quantizer, then the op."""
    from cco.nn.linear import quantize_activation

    a, a_scale = quantize_activation(x, quant, k_padded=layer.k_padded, m_padded=layer._rows_for(x.shape[0]))
    return layer.op(a, layer.qweight, a_scale, layer.weight_scale)


def graph_device_us(arms, args, time_arms) -> dict:
    """Per arm, device us/call: a CUDA graph of ``--graph-calls`` calls, replayed (``time_arms``)."""
    return {name: t.median_us / args.graph_calls
            for name, t in graph_timings(arms, args.graph_calls, args.passes, time_arms).items()}


def one_weight_and_cold(arms: dict, others: list[dict], timed) -> tuple[dict, dict]:
    """``(one weight, cold)``: ``timed(graph arms)``'s times of ``arms`` as given, and, where
    ``others`` (the same arms over other weights, ``--cold``) are given, of each arm as a graph
    whose calls take ``arms``' and then each of ``others``' in turn (empty without ``others``).
    Both kinds go to ``timed`` in one dict, so they are timed in the same passes."""
    timed_all = timed({**arms, **{a + COLD: [fn] + [o[a] for o in others] for a, fn in arms.items() if others}})
    return ({a: t for a, t in timed_all.items() if not a.endswith(COLD)},
            {a.removesuffix(COLD): t for a, t in timed_all.items() if a.endswith(COLD)})


def graph_calls_of(fns, calls: int) -> list:
    """The ``calls`` callables a graph of the arm ``fns`` captures, in order: a callable ``calls``
    times, or a list of them in turn (call ``j`` the ``j % len``-th)."""
    fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
    if not fns or calls < 1:
        raise ValueError(f"graph_calls_of: {len(fns)} callables, {calls} calls: each must be >= 1")
    return [fns[j % len(fns)] for j in range(calls)]


def graph_timings(arms, calls: int, passes: int, time_arms) -> dict:
    """Per arm, ``time_arms``' timing (median, spread over passes) of one replay of a CUDA graph of
    ``calls`` calls, the arms alternating per pass (each warmed up on a side stream first). An arm
    given as a list of callables makes call ``j`` of its graph with its ``j % len``-th (``--cold``:
    each call on its own weight, as a model's layers follow each other)."""
    graphs = {}
    for name, fns in arms.items():
        captured = graph_calls_of(fns, calls)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                for fn in dict.fromkeys(captured):  # each distinct callable (its first call compiles)
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in captured:
                fn()
        graphs[name] = g
    return time_arms({name: (lambda i, g=g: g.replay()) for name, g in graphs.items()}, passes=passes, iters=10,
                     rotate=1)


def profile_calls(args, comm, device, path: str) -> None:
    """cProfile of eager calls at the first shape: per quant of ``--quant`` and M of ``-m``, the layer
    (its rule's path: the decode GEMM up to ``decode_rows`` rows, else quantizer + op) and
    ``nn.Linear``; at the first quant and M also the registered op (``torch.ops.cco.row_parallel_linear``).
    Every rank runs the calls (at world >= 2 they are collective); rank 0's tables go to ``path``."""
    import cProfile
    import io
    import pstats

    n, k = next(iter(shapes(args.shapes).values()))
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    layers = {q: cco_layer(linear, q, comm, m_max=max(256, max(args.m))) for q in args.quant}
    calls = {}
    for i, m in enumerate(args.m):
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        calls[f"nn.Linear bf16, M={m}"] = lambda x=x: linear(x)
        for j, (q, layer) in enumerate(layers.items()):
            how = "decode GEMM" if m <= layer.decode_rows else "quantizer + op"
            calls[f"layer {q}, M={m} ({how})"] = lambda x=x, layer=layer: layer(x)
            if i == j == 0:
                calls[f"torch.ops.cco.row_parallel_linear {q}, M={m}"] = lambda x=x, layer=layer: \
                    torch.ops.cco.row_parallel_linear(x, layer.qweight, layer.weight_scale, None, None, layer._handle, n)
    with open(path if comm.rank == 0 else os.devnull, "w") as f, torch.no_grad():
        for name, fn in calls.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.profile_calls):
                fn()
            prof.disable()
            spent = (time.perf_counter() - t0) / args.profile_calls * 1e6
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(r"cco/|kernels_fused/", 40)
            f.write(f"==== {name}, world {comm.world}, rank {comm.rank}: {spent:.1f} us/call under the profiler, "
                    f"{args.profile_calls} calls\n{s.getvalue()}\n")
            if comm.rank == 0:
                print(f"profiled {name}: {spent:.1f} us/call under the profiler", flush=True)
    for layer in layers.values():
        layer.close()


# --------------------------------------------------------------------------------------------------
def timed_model_rows(model_rows) -> list[dict]:
    """The model's records :func:`plot` draws: those with times (``modes``; not --smoke's, not a
    failed arm's)."""
    return [r for r in model_rows if isinstance(r, dict) and r.get("modes")]


def plot(model_rows, path: str) -> None:
    import matplotlib

    if not timed_model_rows(model_rows):  # (an empty plot is no result: said, no file written)
        raise SystemExit(f"bench_decode: --plot {path}: no model arm has times to draw (every arm failed, or the "
                         f"rows are --smoke's)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_rows = timed_model_rows(model_rows)
    pass_ratios(model_rows)
    batches = sorted({r["batch"] for r in model_rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 9), squeeze=False)
    for col, batch in enumerate(batches):
        rows = [r for r in model_rows if r["batch"] == batch and "modes" in r]
        names = [r["arm"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        # (a run before the thread's CPU time was kept has no such mode)
        modes = [m for m in ("eager", CPU_MODE, "graph") if any(m in r["modes"] for r in rows)]
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            x = [j + width * i for j in range(len(rows))]
            t = [r["modes"].get(mode, {}) for r in rows]
            med = [m.get("ms_per_token", float("nan")) for m in t]
            top.bar(x, med, width=width, label=mode, color=MODE_COLORS[mode],
                    yerr=_whiskers(med, [m.get("min") for m in t], [m.get("max") for m in t]))
            vs = [m.get("vs_bf16", {}) for m in t]
            ratio = [v.get("median", float("nan")) for v in vs]
            bottom.bar(x, ratio, width=width, label=mode, color=MODE_COLORS[mode],
                       yerr=_whiskers(ratio, [v.get("min") for v in vs], [v.get("max") for v in vs]))
        for ax in (top, bottom):
            ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(rows))], names, rotation=30, ha="right")
        top.set_ylabel("ms / token (median, min..max over passes)")
        top.set_title(f"greedy decode, batch {batch}")
        top.legend()
        bottom.axhline(1.0, color=MODE_COLORS["eager"], linestyle="--", linewidth=1, label="eager target (1.0x)")
        bottom.axhline(0.8, color=MODE_COLORS["graph"], linestyle="--", linewidth=1, label="graph target (0.8x)")
        bottom.set_ylabel("time over bf16's, pass by pass (lower is better)")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _whiskers(values, lows, highs) -> list:
    """matplotlib's ``yerr`` (below, above) for bars at ``values`` spanning ``lows..highs``; none where
    a bar has no range (bf16's own ratio)."""
    return [[v - lo if lo is not None else 0 for v, lo in zip(values, lows)],
            [hi - v if hi is not None else 0 for v, hi in zip(values, highs)]]


HOST_TARGET, DEVICE_TARGET = 1.5, 0.8  # the per-call targets against nn.Linear: eager host time, graph device time


def per_call_plot_rows(per_call_rows) -> list[dict]:
    """The per-call records :func:`plot_per_call` draws: world 1's, which have ``nn.Linear``'s arm."""
    return [r for r in per_call_rows if isinstance(r, dict) and "nn.Linear bf16" in r.get("eager", {})]


PLOT_COLUMNS = 4  # --plot-per-call: shapes per row of the grid


def plot_per_call(per_call_rows, path: str) -> None:
    """One column per shape: the layer's eager host time (top) and its device time under graph
    replay (bottom) over M, each against ``nn.Linear``'s in the same run, a line per quant, the
    targets dashed (**lower is better**); with ``--cold``'s times, the device panel draws them solid
    and the one-weight graphs' dotted. World-1 rows only (the others have no ``nn.Linear`` arm)."""
    import matplotlib

    rows = per_call_plot_rows(per_call_rows)
    if not rows:  # (an empty plot is no result: said, no file written)
        raise SystemExit(f"bench_decode: --plot-per-call {path}: no per-call row has the nn.Linear bf16 arm to "
                         f"draw against (world-1 runs have it; world W runs have none)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape_names = list(dict.fromkeys(r["shape"] for r in rows))
    quants = list(dict.fromkeys(a[4:] for r in rows for a in r["eager"] if a.startswith("cco ") and ":" not in a
                                and JIT_ARM not in a and PY_ARM not in a))
    # shapes in a grid of at most PLOT_COLUMNS columns, each shape's host panel above its device panel
    cols = min(PLOT_COLUMNS, len(shape_names))
    grid_rows = 2 * -(-len(shape_names) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(5.5 * cols, 4 * grid_rows), squeeze=False)
    for i in range(len(shape_names), grid_rows // 2 * cols):  # a last grid row's empty places
        axes[2 * (i // cols)][i % cols].set_visible(False)
        axes[2 * (i // cols) + 1][i % cols].set_visible(False)
    for i, shape in enumerate(shape_names):
        col, top = i % cols, 2 * (i // cols)
        mine = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["m"])
        ms = [r["m"] for r in mine]
        for row, (what, target) in enumerate((("host", HOST_TARGET), ("graph", DEVICE_TARGET))):
            ax = axes[top + row][col]
            cold = what == "graph" and any("graph_us_cold" in r for r in mine)
            for j, q in enumerate(quants):
                color = f"C{j}"
                if what == "host":
                    ratio = [r["eager"][f"cco {q}"]["host_us"] / r["eager"]["nn.Linear bf16"]["host_us"] for r in mine]
                    ax.plot(ms, ratio, marker="o", color=color, label=q)
                    continue
                for key, style, label in (("graph_us", ":" if cold else "-", f"{q}, one weight" if cold else q),
                                          ("graph_us_cold", "-", f"{q}, cold (a weight a call)")):
                    if key == "graph_us_cold" and not cold:
                        continue
                    ratio = [r.get(key, {}).get(f"cco {q}", float("nan")) /
                             r.get(key, {}).get("nn.Linear bf16", float("nan")) for r in mine]
                    ax.plot(ms, ratio, marker="o" if style == "-" else ".", linestyle=style, color=color, label=label)
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}x")
            ax.axhline(1.0, color="grey", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (rows of the call)")
            ax.set_ylabel(("eager host time" if what == "host" else "device time, graph replay")
                          + " / nn.Linear's (lower is better)", fontsize=8)
            n, k = mine[0]["n"], mine[0]["k"]
            ax.set_title(f"{shape} (N {n}, K {k}): {'host' if what == 'host' else 'device'}", fontsize=10)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def smoke_failures(runs: list[dict]) -> list[str]:
    """The ``--smoke`` records (``model_runs``) of arms that raised or decoded non-finite logits."""
    return [f"batch {r['batch']} {r['arm']}: " + (r["error"] if "error" in r else "non-finite logits")
            for r in runs if "error" in r or not r.get("ok")]


def main(argv=None) -> int:
    args = parse_args(argv)

    if args.from_json:  # plots of an earlier run: no GPU, no ranks
        try:
            with open(args.from_json) as f:
                earlier = json.load(f)
        except (OSError, ValueError) as err:
            raise SystemExit(f"bench_decode: --from {args.from_json}: {err}")
        if not isinstance(earlier, dict):
            raise SystemExit(f"bench_decode: --from {args.from_json}: not a bench_decode --json (an object with "
                             f"'model' and/or 'per_call'), a {type(earlier).__name__}")
        model = earlier.get("model")
        if not (args.plot or args.plot_per_call):  # the model's table, with each arm's pass-by-pass ratios
            runs = model.get("runs") if isinstance(model, dict) else None
            runs = timed_model_rows(runs) if isinstance(runs, list) else []
            if not runs:
                raise SystemExit(f"bench_decode: --from {args.from_json}: no model rows with times to print; "
                                 f"pass --plot-per-call to draw a per-call run")
            pass_ratios(runs)
            for record in runs:
                print(model_line(record))
            return 0
        plots = [(args.plot, "model rows (model.runs with times)", plot, timed_model_rows,
                  model.get("runs") if isinstance(model, dict) else None),
                 (args.plot_per_call, "per_call rows with the nn.Linear bf16 arm (a world-1 run's)", plot_per_call,
                  per_call_plot_rows, earlier.get("per_call"))]
        for path, what, _, drawn, rows in plots:  # every plot's rows checked before any file is written
            if path and not (isinstance(rows, list) and drawn(rows)):
                raise SystemExit(f"bench_decode: {args.from_json} has no {what} to draw")
        for path, _, draw, _, rows in plots:
            if path:
                draw(rows, path)
        return 0

    if not args.smoke:
        from cco.bench.timing import require_cuda

        require_cuda("bench_decode")  # (--smoke runs on the CPU)
    if args.smoke:
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab, args.layers = 256, 512, 4, 2, 512, 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    comm = launched_or_one_rank(device)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python3 -m scripts.bench_decode " + " ".join(sys.argv[1:] if argv is None else argv),
              "world": comm.world}

    def save():  # after every section and shape: a run cut short keeps what it measured
        if comm.rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    with comm:
        if not args.smoke:
            from cco.window import ranks_share_a_device
            from kernels_fused.hopper import native as NV
            result.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          shared_gpu=ranks_share_a_device(comm) if comm.world > 1 else False,
                          native=("loaded" if NV.start(wait=600) else f"not loaded: {NV.error()}") if NV.ENABLED
                          else "off (CCO_DECODE_NATIVE=0)")  # the decode GEMM's C++ call path, before any timing
        if comm.world == 1 and not args.per_call_only:
            result["model"] = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                               "prompt": args.prompt, "tokens": args.tokens, "runs": model_runs(args, comm, device)}
            save()
        if args.profile and not args.model_only:  # every rank calls (collective); rank 0 writes
            profile_calls(args, comm, device, profile_path(args, "profile"))
        if not args.model_only and not args.smoke:
            result["per_call"] = []
            per_call_runs(args, comm, device, into=result["per_call"], after_shape=save)
        save()
        if comm.rank == 0:
            print("RESULT_JSON " + json.dumps(result), flush=True)
        # the plots after the JSON and its RESULT_JSON line: one with nothing to draw (SystemExit) loses no numbers
        if args.plot and comm.rank == 0:
            plot(result["model"]["runs"], args.plot)
        if args.plot_per_call and comm.rank == 0:
            plot_per_call(result["per_call"], args.plot_per_call)
    # --smoke: any arm that raised or decoded non-finite logits fails the run (world 1: the model runs there only)
    failed = smoke_failures(result.get("model", {}).get("runs", [])) if args.smoke else []
    if failed:
        print("bench_decode --smoke: FAILED: " + "; ".join(failed), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
