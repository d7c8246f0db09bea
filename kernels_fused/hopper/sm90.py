"""A Triton kernel compiled for sm_90 (Hopper) by the Triton installed on this host, no GPU needed:
what ``walk_ptx`` and ``lsa_ptx`` read or check. Not under Triton's interpreter (run it in a
process of its own)."""

from __future__ import annotations


def sm90_ptx(fn, signature: dict, constexprs: dict, config) -> str:
    """The PTX of the JIT function ``fn`` compiled for sm_90 with the argument types ``signature``
    (name -> Triton type string), the ``constexprs`` (name -> value; added to the signature here)
    and ``config``'s ``num_warps`` and ``num_stages``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["ptx"]
