"""Model configurations and the emulated fused model, shared by the CPU (test_hf_tp) and GPU
(test_cuda_hf) tests of ``cco.integrations.hf``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from cco import layout
from cco import quant as Q
from examples.hf_generate import tiny_llama_config

_SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def family_config(family: str):
    if family == "llama":
        return tiny_llama_config()
    if family in ("deepseek_v2", "deepseek_v3"):  # MLA attention; layer 0 dense, layer 1 MoE with a shared expert
        cls = transformers.DeepseekV2Config if family == "deepseek_v2" else transformers.DeepseekV3Config
        return cls(**{**_SMALL, "num_key_value_heads": 4}, moe_intermediate_size=128, q_lora_rank=None,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4,
                   n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1)
    cls, extra = {"qwen2": (transformers.Qwen2Config, {}), "qwen3": (transformers.Qwen3Config, {}),
                  "mistral": (transformers.MistralConfig, {}), "gemma3": (transformers.Gemma3TextConfig, {}),
                  "olmo": (transformers.OlmoConfig, {}), "starcoder2": (transformers.Starcoder2Config, {}),
                  "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4}),
                  "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 128,
                                                              "mlp_only_layers": [0]}),
                  # its defaults name tokens of a 32k vocabulary
                  "phi3": (transformers.Phi3Config, {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}),
                  }[family]
    return cls(**_SMALL, **extra)


def emulated_row_parallel(x, w, b, *, world: int, quant: str):
    """``all_reduce(x_r @ W_r.T) + b`` with each rank's operands quantized as RowParallelLinear
    quantizes them (K padded to whole 128 tiles), partials in fp32 rounded to bf16, summed in fp32."""
    n, k = w.shape[0], w.shape[1] // world
    kp = layout.padded_k(k)
    x2 = x.reshape(-1, w.shape[1]).float()
    total = 0
    for r in range(world):
        cols = slice(r * k, (r + 1) * k)
        a, a_s = Q.quantize_a(F.pad(x2[:, cols], (0, kp - k)), quant)
        q, q_s = Q.quantize_b(F.pad(w[:, cols].float(), (0, kp - k)), quant)
        total = total + Q.reference_gemm(a, q, a_s, q_s, quant).float()
    y = total.to(torch.bfloat16)
    if b is not None:
        y = y + b.to(torch.bfloat16)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def emulate_fused(model, names, *, world: int, quant: str):
    """``model`` (whole, one rank) with the modules ``names`` computing as the fused layers do."""
    for name in names:
        mod = model.get_submodule(name)
        mod.forward = lambda x, mod=mod: emulated_row_parallel(x, mod.weight, mod.bias, world=world, quant=quant)
    return model
