"""Tiny random mixture-of-experts models built from transformers' own configurations (tests of issue 33).

Each is a 2-layer model with hidden size 64, seeded random weights at a larger-than-default scale (so
that routing and quantization errors are not vanishingly small), in eval mode, built in well under a second.
"""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
CONFIGS = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, layer_types=["full_attention"] * 2),
    "qwen2_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=64),
    "deepseek_v3": dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256),
}
MOE_TYPES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3")


def config(model_type: str, **overrides):
    fields = {} if model_type == "gpt2" else dict(COMMON)
    fields.update(CONFIGS[model_type])
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def build(model_type: str, seed: int = 0, std: float = 0.08, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(model_type, **overrides))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
    return model.eval()


def plain_expert_matrices(model_type: str, gate_up: torch.Tensor, down: torch.Tensor, expert: int
                          ) -> dict[str, torch.Tensor]:
    """Expert ``expert``'s [out, in] gate/up/down matrices, sliced by hand from the fused parameters:
    the layout as each family's modeling file documents it, written independently of harness.quant.experts."""
    if model_type == "gpt_oss":  # [E, H, 2I] interleaved gate/up columns; down [E, I, H]
        w = gate_up[expert]
        return {"gate_proj": w[:, 0::2].t(), "up_proj": w[:, 1::2].t(), "down_proj": down[expert].t()}
    half = gate_up.shape[1] // 2  # [E, 2I, H] = [gate; up]; down [E, H, I]
    return {"gate_proj": gate_up[expert, :half], "up_proj": gate_up[expert, half:], "down_proj": down[expert]}
