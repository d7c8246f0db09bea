"""cco's sequence-parallel styles under torch's ``parallelize_module``, against torch's own.

A Llama-like MLP block (RMSNorm under torch's ``SequenceParallel``, gate/up column-wise from the
sequence-sharded norm output, down row-wise into a sequence-sharded output, residual add) is
parallelized twice on two CPU ranks (gloo): with torch's ``ColwiseParallel(input_layouts=Shard(1))``
/ ``RowwiseParallel(output_layouts=Shard(1))`` and with cco's ``FusedColwiseParallel`` /
``FusedRowwiseParallel`` (the all-gather + GEMM and the GEMM + reduce-scatter of
``cco.nn.ColumnParallelLinear`` / ``RowParallelLinear(sequence_parallel=True)``). Compared: the output's
DTensor placements, its full value and the input gradient, within the fp8 budget of torch's bf16
result, for ``[batch > 1, seq, hidden]`` (the layout moves), ``batch == 1`` and ``[seq, hidden]``
with ``Shard(0)`` (no move). A token-order mistake (a rank's block of the wrong batch entry or the
wrong sequence block) moves whole rows and shows as an O(1) error, far above the budget. Refused
cases (a replicated input, a scatter along the features, a sequence that does not split, too many
tokens for ``m_max``, not a Linear, an output width that does not split) raise on both ranks, which
then go on in step.
"""

from __future__ import annotations

import os

import pytest
import torch

from cco import quant as Q
from tests.python.cco.errors import error_of

WORLD = 2
M_MAX = 64
H, INTER = 128, 256
SPAWN_TIMEOUT_S = 120
# rel. L2 against torch's bf16 styles: fp8 operands (ptpc) in three GEMMs of one block; a token-order
# or a bias mistake is O(1) (measured: ~0.03 on the block's output, ~0.055 on the input gradient, which
# goes back through the three fp8 weights and the loss's own fp8 error; cco.nn.sequence's budget: 0.1)
FP8_TOL = 0.06
GRAD_TOL = 0.1


class MLPBlock(torch.nn.Module):
    """``x + down(silu(gate(norm(x))) * up(norm(x)))``, Llama's MLP half of a decoder layer."""

    def __init__(self, *, seed: int = 0, down_bias: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = torch.nn.RMSNorm(H, eps=1e-6)
        self.gate = torch.nn.Linear(H, INTER, bias=False)
        self.up = torch.nn.Linear(H, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, H, bias=down_bias)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
            for lin in (self.gate, self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
            if down_bias:
                self.down.bias.copy_(0.5 * torch.randn(H, generator=g))
        self.to(torch.bfloat16)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _plans(seq: int):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from cco.integrations.dtensor import FusedColwiseParallel, FusedRowwiseParallel

    s = Shard(seq)
    torch_plan = {"norm": SequenceParallel(sequence_dim=seq), "gate": ColwiseParallel(input_layouts=s),
                  "up": ColwiseParallel(input_layouts=s), "down": RowwiseParallel(output_layouts=s)}
    cco_plan = {"norm": SequenceParallel(sequence_dim=seq), "gate": FusedColwiseParallel(input_layouts=s, m_max=M_MAX),
                "up": FusedColwiseParallel(input_layouts=s, m_max=M_MAX),
                "down": FusedRowwiseParallel(output_layouts=s, m_max=M_MAX)}
    return torch_plan, cco_plan


def _compare(comm, mesh, shape, seq, *, down_bias=False):
    """One block under both plans: this rank's slice of the global input ``shape`` along ``seq``."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch_plan, cco_plan = _plans(seq)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    x_r = x.chunk(WORLD, dim=seq)[comm.rank].contiguous()
    out = {}
    for name, plan in (("torch", torch_plan), ("cco", cco_plan)):
        block = parallelize_module(MLPBlock(down_bias=down_bias), mesh, plan)
        xg = x_r.clone().requires_grad_(True)
        y_r = block(xg)
        y_r.float().square().sum().backward()  # the loss's local part; its gradient is what each rank owns
        full = torch.cat(comm.all_gather_object(y_r.detach()), dim=seq)
        grad = torch.cat(comm.all_gather_object(xg.grad), dim=seq)
        out[name] = {"local_shape": list(y_r.shape), "full": full, "grad": grad, "block": block}
    # the down projection alone with use_local_output=False: the DTensor placements torch's style returns
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel

    from cco.integrations.dtensor import FusedColwiseParallel, FusedRowwiseParallel

    h = torch.randn(*shape[:-1], INTER, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    placements = {}
    for name, style in (("torch", RowwiseParallel(output_layouts=Shard(seq), use_local_output=False)),
                        ("cco", FusedRowwiseParallel(output_layouts=Shard(seq), use_local_output=False, m_max=M_MAX))):
        down = parallelize_module(MLPBlock(down_bias=down_bias).down, mesh, style)
        y = down(distribute_tensor(h, mesh, [Shard(len(shape) - 1)]))
        placements[name] = (type(y).__name__, tuple(y.placements), y.full_tensor().detach())
    for name, style in (("torch", torch.distributed.tensor.parallel.ColwiseParallel(
                            input_layouts=Shard(seq), use_local_output=False)),
                        ("cco", FusedColwiseParallel(input_layouts=Shard(seq), use_local_output=False, m_max=M_MAX))):
        gate = parallelize_module(MLPBlock().gate, mesh, style)
        y = gate(distribute_tensor(x, mesh, [Shard(seq)]))  # a DTensor input, as SequenceParallel's output
        placements[f"col_{name}"] = (type(y).__name__, tuple(y.placements), y.full_tensor().detach())
    t, c = out["torch"], out["cco"]
    return {"local_shape": (t["local_shape"], c["local_shape"]), "out": Q.rel_l2(c["full"], t["full"]),
            "grad": Q.rel_l2(c["grad"], t["grad"]), "grad_norm": float(c["grad"].float().norm()),
            "fused": [type(c["block"].get_submodule(n).fused).__name__ for n in ("gate", "up", "down")],
            "row_placements": (placements["torch"][:2], placements["cco"][:2]),
            "row_out": Q.rel_l2(placements["cco"][2], placements["torch"][2]),
            "col_placements": (placements["col_torch"][:2], placements["col_cco"][:2]),
            "col_out": Q.rel_l2(placements["col_cco"][2], placements["col_torch"][2])}


def _rank_main(comm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from cco.integrations.dtensor import FusedColwiseParallel, FusedRowwiseParallel

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {"batch2": _compare(comm, mesh, (2, 16, H), 1, down_bias=True),
           "batch1": _compare(comm, mesh, (1, 32, H), 1),
           "seq_first": _compare(comm, mesh, (24, H), 0)}
    # refused: at construction (no rank touches the mesh), at apply (global shapes), at the call
    out["replicated_input"] = error_of(lambda: FusedColwiseParallel())
    out["feature_scatter"] = error_of(lambda: FusedRowwiseParallel(output_layouts=Shard(-1)))
    out["not_a_linear"] = error_of(lambda: parallelize_module(torch.nn.LayerNorm(H), mesh,
                                                             FusedColwiseParallel(input_layouts=Shard(1))))
    out["uneven_out"] = error_of(lambda: parallelize_module(torch.nn.Linear(H, 129), mesh,
                                                           FusedColwiseParallel(input_layouts=Shard(1))))
    # in a plan over a model: the refusal says which module (torch gives the style the module alone)
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([MLPBlock(), torch.nn.ModuleDict(
        {"norm": torch.nn.LayerNorm(H)})])})
    out["not_a_linear_in_plan"] = error_of(lambda: parallelize_module(
        model, mesh, {"blocks.1.norm": FusedColwiseParallel(input_layouts=Shard(1))}), notes=True)
    col = parallelize_module(MLPBlock().gate, mesh, FusedColwiseParallel(input_layouts=Shard(1), m_max=M_MAX))
    row = parallelize_module(MLPBlock().down, mesh, FusedRowwiseParallel(output_layouts=Shard(1), m_max=M_MAX))
    odd = torch.randn(2, 15, H).to(torch.bfloat16)
    out["col_odd_seq"] = error_of(lambda: col(distribute_tensor(odd, mesh, [Shard(1)])))
    out["row_odd_seq"] = error_of(lambda: row(torch.randn(2, 15, INTER // WORLD).to(torch.bfloat16)))
    out["row_features"] = error_of(lambda: parallelize_module(
        MLPBlock().down, mesh, FusedRowwiseParallel(output_layouts=Shard(2), m_max=M_MAX))(
            torch.randn(2, 16, INTER // WORLD).to(torch.bfloat16)))
    out["row_too_many"] = error_of(lambda: row(torch.randn(4, 32, INTER // WORLD).to(torch.bfloat16)), notes=True)
    # in a plan: the call's error names the module the layer stands in for (raised deep in a forward)
    planned = parallelize_module(MLPBlock(), mesh, {"down": FusedRowwiseParallel(output_layouts=Shard(1),
                                                                                   m_max=M_MAX)})
    out["row_too_many_in_plan"] = error_of(
        lambda: planned.down(torch.randn(4, 32, INTER // WORLD).to(torch.bfloat16)), notes=True)
    # a process group where the mesh goes: refused naming the DeviceMesh (an AttributeError before)
    out["mesh_is_a_group"] = error_of(lambda: parallelize_module(MLPBlock().down, torch.distributed.group.WORLD,
                                                                 FusedRowwiseParallel(m_max=M_MAX)))
    # one rank's sequence does not split (its global shape is built from its own local one): that
    # rank raises, its peer fails the same call, and the next call pairs rightly
    seq = 15 if comm.rank == 1 else 16
    out["row_odd_one_rank"] = error_of(lambda: row(torch.randn(2, seq, INTER // WORLD).to(torch.bfloat16)))
    out["in_step_after_errors"] = comm.all_gather_object(comm.rank)
    # the layers still run after the refused calls; a replicated DTensor input is redistributed to Shard(1)
    xr = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y = col(distribute_tensor(xr, mesh, [Replicate()]))
    ref = xr @ MLPBlock().gate.weight.t()
    out["after_errors"] = Q.rel_l2(torch.cat(comm.all_gather_object(y), dim=-1), ref)
    # a DTensor input in another layout than Shard(-1) is redistributed (torch's input step passes a
    # DTensor on as it is): the row-wise layer, all-reduce and sequence-parallel, as for Shard(-1)
    xd = torch.randn(2, 16, INTER, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    want = xd @ MLPBlock().down.weight.t()
    ar = parallelize_module(MLPBlock().down, mesh, FusedRowwiseParallel(m_max=M_MAX))
    out["row_dtensor_inputs"] = {}
    for name, placement in (("Shard(-1)", Shard(-1)), ("Replicate()", Replicate()), ("Shard(0)", Shard(0))):
        found = []
        for layer, whole in ((ar, lambda y: y), (row, lambda y: torch.cat(comm.all_gather_object(y), dim=1))):
            try:
                found.append(Q.rel_l2(whole(layer(distribute_tensor(xd, mesh, [placement]))), want) < FP8_TOL)
            except Exception as err:
                found.append(f"{type(err).__name__}: {str(err)[:100]}")
        out["row_dtensor_inputs"][name] = found
    return out


@pytest.fixture(scope="module")
def ranks():
    from cco.comm import check_outcomes, spawn

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return check_outcomes(spawn(_rank_main, world=WORLD, timeout_s=SPAWN_TIMEOUT_S))


@pytest.mark.multirank
@pytest.mark.parametrize("case,local_shape", [("batch2", [2, 8, H]), ("batch1", [1, 16, H]), ("seq_first", [12, H])])
def test_sequence_parallel_block_matches_torchs_styles(ranks, case, local_shape):
    for r in ranks:
        got = r[case]
        assert got["fused"] == ["ColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear"]
        assert got["local_shape"] == (local_shape, local_shape)
        assert got["out"] < FP8_TOL, got
        assert got["grad"] < GRAD_TOL and got["grad_norm"] > 0, got
        assert got["row_out"] < FP8_TOL and got["col_out"] < FP8_TOL, got
    assert ranks[0][case]["out"] == ranks[1][case]["out"]  # both ranks hold the same gathered output


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["batch2", "batch1", "seq_first"])
def test_dtensor_outputs_have_torchs_placements(ranks, case):
    for r in ranks:
        (t_kind, t_pl), (c_kind, c_pl) = r[case]["row_placements"]
        assert c_kind == t_kind == "DTensor" and c_pl == t_pl, r[case]["row_placements"]
        (t_kind, t_pl), (c_kind, c_pl) = r[case]["col_placements"]
        assert c_kind == t_kind == "DTensor" and [p.dim % 3 for p in c_pl] == [p.dim % 3 for p in t_pl], \
            r[case]["col_placements"]


@pytest.mark.multirank
def test_refused_cases_raise_on_every_rank_and_the_ranks_stay_in_step(ranks):
    expected = {
        "replicated_input": "ValueError: FusedColwiseParallel: input_layouts=None is not fused here",
        "feature_scatter": "ValueError: FusedRowwiseParallel: output_layouts=Shard(dim=-1) is not fused here",
        "not_a_linear": "TypeError: FusedColwiseParallel: 'LayerNorm under FusedColwiseParallel' is a LayerNorm",
        "uneven_out": "ValueError: FusedColwiseParallel: 'Linear under FusedColwiseParallel' has out_features=129",
        "col_odd_seq": "ValueError: FusedColwiseParallel: the sequence dimension 1 of the input [2, 15, 128] has 15",
        "row_odd_seq": "ValueError: FusedRowwiseParallel: the sequence dimension 1 of the input [2, 15, 256] has 15",
        "row_features": "ValueError: FusedRowwiseParallel: output_layouts=Shard(dim=2) on an input of shape",
        "row_too_many": "ValueError: RowParallelLinear: a call of 128 rows but the layer was built with m_max=64",
    }
    for r in ranks:
        for key, prefix in expected.items():
            assert r[key].startswith(prefix), (key, r[key])
        assert r["row_too_many"].endswith("\n(raised by the cco layer that stands in for 'Linear under "
                                          f"FusedRowwiseParallel'; its options, m_max={M_MAX} among them, are the "
                                          "plan's style's)"), r["row_too_many"]
        assert r["row_too_many_in_plan"].startswith(expected["row_too_many"]), r["row_too_many_in_plan"]
        assert "stands in for 'down' (Linear under FusedRowwiseParallel)" in r["row_too_many_in_plan"], \
            r["row_too_many_in_plan"]
        assert r["mesh_is_a_group"].startswith("TypeError: FusedRowwiseParallel: the mesh must be a 1-D torch "
                                               "DeviceMesh, got a ProcessGroup"), r["mesh_is_a_group"]
        # the same refusal in a plan over a model, with the module's path (before: its class alone)
        assert r["not_a_linear_in_plan"].startswith(expected["not_a_linear"]), r["not_a_linear_in_plan"]
        assert r["not_a_linear_in_plan"].endswith(
            "\n(the module 'blocks.1.norm' of the model passed to parallelize_module)"), r["not_a_linear_in_plan"]
    # before the rejection, rank 0's call returned (paired with rank 1's next call's rows) and rank 0
    # waited out its deadline a call later
    assert ranks[1]["row_odd_one_rank"].startswith(expected["row_odd_seq"]), ranks[1]["row_odd_one_rank"]
    assert ranks[0]["row_odd_one_rank"].startswith("PeerRejectedError") and "rank 1" in ranks[0]["row_odd_one_rank"], \
        ranks[0]["row_odd_one_rank"]
    for r in ranks:
        assert r["in_step_after_errors"] == list(range(WORLD))
        assert r["after_errors"] < FP8_TOL


@pytest.mark.multirank
def test_a_dtensor_input_in_another_layout_is_redistributed(ranks):
    """Before: the row-wise styles took ``to_local()`` of whatever DTensor came in, and a
    ``Replicate()`` or token-sharded input raised "x has 256 features ... but the layer takes
    in_features_per_rank=128" on both ranks, where torch's own RowwiseParallel gives the product."""
    for r in ranks:
        assert r["row_dtensor_inputs"] == {name: [True, True] for name in ("Shard(-1)", "Replicate()", "Shard(0)")}, \
            r["row_dtensor_inputs"]
