"""Model configurations, fp8 checkpoints and the emulated fused model, shared by the CPU (test_hf_tp,
test_hf_fp8) and GPU (test_cuda_hf) tests of ``cco.integrations.hf``."""

from __future__ import annotations

import contextlib
import json
import os

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


# ---- fp8 checkpoints ------------------------------------------------------------------------------
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_llama_config(intermediate: int = 512):
    # head_dim 128 and 2 kv heads: every column-parallel shard is whole 128-row blocks too, which
    # transformers' own dequantization of a sharded block-scaled weight needs
    return transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=intermediate,
                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                    max_position_embeddings=128, tie_word_embeddings=False)


def _proj_weights(path: str, intermediate: int, seed: int) -> dict:
    """A random Llama saved with ``save_pretrained`` at ``path``; its tensors."""
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(fp8_llama_config(intermediate)).to(torch.bfloat16) \
        .save_pretrained(path)
    return load_file(os.path.join(path, "model.safetensors"))


def _save(path: str, tensors: dict, quantization_config: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def write_fp8_llama(path: str, *, intermediate: int = 512, seed: int = 0, scales: str = "block") -> None:
    """A random Llama saved with ``save_pretrained``, then every ``*_proj.weight`` rewritten as e4m3
    + ``weight_scale_inv``; embeddings, norms and lm_head stay bf16. ``scales``: "block" (DeepSeek-V3:
    fp32 [ceil(N/128), ceil(K/128)]), "ue8m0" (DeepSeek-V3.1: the same, powers of two, the config's
    ``scale_fmt`` "ue8m0"), "tensor" (one fp32 scale ``[]``, the config's ``weight_block_size`` None)."""
    if scales not in ("block", "ue8m0", "tensor"):
        raise ValueError(f"write_fp8_llama: scales={scales!r}: 'block', 'ue8m0' or 'tensor'")
    tensors = _proj_weights(path, intermediate, seed)
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[key].float()
        n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        # magnitudes that differ by block, so a scale read from the wrong block shows; fp32 values (a
        # checkpoint quantized from fp32 masters), so a block's scale is no bf16 value over 448 and
        # transformers' bf16 dequantization, quantized again, does not give the stored bytes back
        w = w * torch.exp2(torch.randint(-2, 3, (nb, kb), generator=g).float()).repeat_interleave(128, 0)[:n] \
            .repeat_interleave(128, 1)[:, :k] * (1 + 0.01 * torch.randn(n, k, generator=g))
        if scales == "tensor":
            scale = w.abs().amax() / Q.FP8_MAX
            full = scale
        else:
            blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
            scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / Q.FP8_MAX
            if scales == "ue8m0":  # the next power of two up: no block's values pass 448
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        tensors[key] = (w / full).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(Q.FP8)
        tensors[key[:-len("weight")] + "weight_scale_inv"] = scale
    config = {**FP8_CONFIG, **({"scale_fmt": "ue8m0"} if scales == "ue8m0" else {}),
              **({"weight_block_size": None} if scales == "tensor" else {})}
    _save(path, tensors, config)


def checkpoint_weight(tensors, key: str) -> torch.Tensor:
    """fp32 [N, K]: the stored e4m3 bytes times their scale, by each format's definition: a scale
    ``weight_scale_inv`` or ``weight_scale`` per tensor ([]), per row ([N, 1]), per 32 columns of a row
    ([N, K/32], e8m0 codes in uint8: 2**(code - 127)) or per 128x128 block ([N/128, K/128])."""
    prefix = key[:-len("weight")]
    q = tensors[key].float()
    scale = tensors.get(prefix + "weight_scale_inv", tensors.get(prefix + "weight_scale"))
    scale = torch.exp2(scale.float() - 127) if scale.dtype == torch.uint8 else scale.float()
    n, k = q.shape
    if scale.dim() < 2 or scale.shape[-1] == 1:
        return q * scale.reshape(-1, 1)
    if scale.shape[0] == n:
        return q * scale.repeat_interleave(32, 1)[:, :k]
    return q * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


# compressed-tensors schemes (its preset names) -> the format the checkpoint's quantization_config names
CT_FORMATS = {"FP8": "float-quantized", "FP8_DYNAMIC": "float-quantized", "FP8_BLOCK": "float-quantized",
              "MXFP8": "mxfp8-quantized"}


def ct_quantization_config(scheme: str, **weights) -> dict:
    """The ``quantization_config`` compressed-tensors writes for its preset ``scheme`` on every Linear
    but ``lm_head`` (its own classes; ``weights`` overrides fields of the weight scheme)."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset = preset_name_to_scheme(scheme, ["Linear"])
    if weights:
        preset.weights = preset.weights.model_copy(update=weights)
    config = QuantizationConfig(config_groups={"group_0": preset}, format=CT_FORMATS.get(scheme, "float-quantized"),
                                quantization_status="compressed", ignore=["lm_head"])
    return json.loads(config.model_dump_json())


def write_ct_llama(path: str, scheme: str, *, seed: int = 0, quantization_config: dict | None = None) -> None:
    """A random Llama whose every ``*_proj.weight`` is e4m3 with a compressed-tensors ``weight_scale``:
    FP8 bf16 [1] (per tensor), FP8_DYNAMIC bf16 [N, 1] (per row), FP8_BLOCK bf16 [N/128, K/128], MXFP8 uint8 e8m0 codes
    [N, K/32], GROUP128 bf16 [N, K/128] (``quantization_config`` to pass). Scales differ by row or
    block (rows scaled by up to 1.5x)."""
    tensors = _proj_weights(path, 512, seed)
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors[key].float() * (1 + 0.5 * torch.rand(tensors[key].shape[0], 1, generator=g))
        n, k = w.shape
        if scheme == "FP8":
            scale = (w.abs().amax() / Q.FP8_MAX).to(torch.bfloat16).reshape(1)
            full = scale.float()
        elif scheme == "FP8_DYNAMIC":
            scale = (w.abs().amax(1, keepdim=True) / Q.FP8_MAX).to(torch.bfloat16)
            full = scale.float()
        elif scheme == "FP8_BLOCK":
            scale = (w.view(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / Q.FP8_MAX).to(torch.bfloat16)
            full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        elif scheme == "MXFP8":
            exp = torch.ceil(torch.log2(w.view(n, k // 32, 32).abs().amax(2) / Q.FP8_MAX)).clamp(-127, 127)
            scale = (exp + 127).to(torch.uint8)
            full = torch.exp2(exp).repeat_interleave(32, 1)
        elif scheme == "GROUP128":  # float scales per 128 columns of a row: a scheme cco does not serve
            scale = (w.view(n, k // 128, 128).abs().amax(2) / Q.FP8_MAX).to(torch.bfloat16)
            full = scale.float().repeat_interleave(128, 1)
        else:
            raise ValueError(f"write_ct_llama: scheme={scheme!r}: one of {sorted(CT_FORMATS)}, GROUP128")
        tensors[key] = (w / full).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(Q.FP8)
        tensors[key[:-len("weight")] + "weight_scale"] = scale
        if scheme == "FP8":  # the preset's static activation scale, per tensor (the fused layers quantize per call)
            tensors[key[:-len("weight")] + "input_scale"] = torch.full((1,), 0.01, dtype=torch.bfloat16)
    _save(path, tensors, quantization_config or ct_quantization_config(scheme))


def reference_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                         allow_deepgemm=True):
    """What transformers' ``fp8_linear`` computes, without its fp8 kernels: ``x @ dequantize(W).T``
    (each scale over its ``block_size`` block, or one per tensor), in the input's dtype."""
    n, k = weight.shape
    scale = weight_scale_inv.float()
    if scale.dim() == 2:
        bn, bk = block_size
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return F.linear(input, (weight.float() * scale).to(input.dtype), bias)


def fp8_kernel_error() -> str | None:
    """Why transformers' ``FP8Linear`` kernel (Triton, fetched from the Hugging Face Hub at run time
    through the ``kernels`` package) cannot be loaded here, or None where it can."""
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as err:  # noqa: BLE001 - ImportError without the package, hub errors without a network
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def fp8_linear_path(*, as_on_sm89: bool = True, reference_kernel: bool):
    """Loading a transformers ``fp8`` checkpoint as transformers 5.17 does on GPUs with fp8 (sm89+):
    every Linear (``lm_head`` aside) becomes its ``FP8Linear``, holding the checkpoint's e4m3 weight
    and ``weight_scale_inv``, and the model is not dequantized.

    ``as_on_sm89``: on a machine without such a GPU the quantizer's ``validate_environment``
    switches to dequantizing; inside this context it passes, as it does on sm89+ (the checks it makes
    there, accelerate and the compute capability, pass). Leave it False on such a GPU.
    ``reference_kernel``: ``FP8Linear.forward`` calls ``fp8_linear``, which runs DeepGEMM or a Triton
    kernel transformers fetches from the Hub at run time (neither runs on CPU, nor without the Hub):
    replaced by :func:`reference_fp8_linear`. Everything else (the module swap, the sharding of
    weight and scales, the loading) is transformers' own."""
    from transformers.integrations import finegrained_fp8
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    saved = FineGrainedFP8HfQuantizer.validate_environment, finegrained_fp8.fp8_linear
    if as_on_sm89:
        FineGrainedFP8HfQuantizer.validate_environment = lambda self, *args, **kwargs: None
    if reference_kernel:
        finegrained_fp8.fp8_linear = reference_fp8_linear
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment, finegrained_fp8.fp8_linear = saved
