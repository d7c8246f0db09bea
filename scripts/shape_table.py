"""Which row-parallel layers of common models run fused at TP 2, 4 and 8, on each backend, with what
zero padding, and the window each holds: the README's table, printed from ``cco.shapes`` (so it
cannot drift from what the backends accept; ``tests/python/cco/test_shapes.py`` compares the two).

    python -m scripts.shape_table                 # the markdown table (quant ptpc, m_max 16384)
    python -m scripts.shape_table --quant blockscale --m-max 4096

A row-parallel layer's weight shard is ``[N, K / TP]``: N the model's hidden size, K the input
features of the layer (the MLP's intermediate size for ``down_proj``, heads x head dim for the
attention output ``o_proj``).
"""

from __future__ import annotations

import argparse

from cco import layout, shapes

# (model, hidden size N, ((layer, input features K, heads K splits by or None), ...)) from the models' published
# configs. The attention output's K splits by whole heads: a TP that does not divide the head count is
# no tensor-parallel layout of that model (Qwen2.5-7B's 28 heads at TP 8), so its row says so.
MODELS = (
    ("Llama-3-8B", 4096, (("mlp.down_proj", 14336, None), ("attn.o_proj", 32 * 128, 32))),
    ("Llama-3-70B", 8192, (("mlp.down_proj", 28672, None), ("attn.o_proj", 64 * 128, 64))),
    ("Qwen2.5-7B", 3584, (("mlp.down_proj", 18944, None), ("attn.o_proj", 28 * 128, 28))),
    ("DeepSeek-V3", 7168, (("mlp.down_proj", 18432, None), ("attn.o_proj", 128 * 128, 128))),  # dense; MLA v_head_dim 128
)
TPS = (2, 4, 8)
COLUMNS = ("cuda", "gfx950", "cpu")  # backends, as cco.shapes names them


def verdict(plan: shapes.LayerShape) -> str:
    if not plan.fused:
        return f"unfused: {plan.reason}"
    return f"fused, pads {plan.padding}" if plan.padding else "fused"


def window_mib(n: int, k: int, tp: int, *, m_max: int, quant: str, backend: str) -> float:
    plan = shapes.layer_shape(n, k, tp, m_max=m_max, backend=backend, quant=quant)
    if not plan.fused:
        return 0.0
    cfg = shapes.build_for(shapes.backend_class(backend=backend), n=plan.n_padded, k=plan.k_padded, m_max=m_max,
                           world=tp, quant=quant)
    return cfg.window.nbytes / 2**20


def rows(*, m_max: int = 16384, quant: str = "ptpc") -> list[list[str]]:
    out = []
    for model, n, layers in MODELS:
        for layer, k_total, heads in layers:
            for tp in TPS:
                k = k_total // tp
                if heads is not None and heads % tp:  # not a layout of this model: no verdict to give
                    out.append([model, layer, str(tp), "-", *[f"no TP {tp} layout: {heads} heads"] * len(COLUMNS), "-"])
                    continue
                cells = [verdict(shapes.layer_shape(n, k, tp, m_max=m_max, backend=b, quant=quant)) for b in COLUMNS]
                mib = window_mib(n, k, tp, m_max=m_max, quant=quant, backend="cuda")
                out.append([model, layer, str(tp), f"{n} x {k}", *cells, f"{mib:.0f} MiB"])
    return out


def markdown(*, m_max: int = 16384, quant: str = "ptpc") -> str:
    head = ["model", "layer", "TP", "shard N x K", *COLUMNS, f"window per rank (cuda, m_max {m_max})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(m_max=m_max, quant=quant)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("--quant", choices=layout.QUANTS, default="ptpc")
    p.add_argument("--m-max", type=int, default=16384, help="the most rows a call takes (>= 1): sizes the window")
    opts = p.parse_args(argv)
    if opts.m_max < 1:
        p.error(f"--m-max {opts.m_max}: must be >= 1 (the most rows a call takes)")
    print(markdown(m_max=opts.m_max, quant=opts.quant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
