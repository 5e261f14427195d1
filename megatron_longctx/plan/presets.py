"""Model and GPU presets for the planner.

Model shapes are the published configurations (Hugging Face ``config.json``) of Llama-3 (8B, 70B;
arXiv:2407.21783), Mixtral-8x7B (arXiv:2401.04088) and DeepSeek-V2-Lite (MLA + MoE, arXiv:2405.04434).
GPU numbers are vendor datasheet values: dense bf16 peak, NVLink per GPU and direction, one 400 Gb/s
NIC per GPU, PCIe Gen5 x16 to the host; host memory per node is the DGX system's (2 TiB for DGX
H100/H200/B200, 1 TiB for DGX A100).
"""

from __future__ import annotations

from .model import ModelShape
from .timing import Hardware

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # Llama-2-7B (arXiv:2307.09288): the model of NeMo's published long-sequence table.
        ModelShape(name="llama2-7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                   kv_channels=128, ffn_hidden_size=11008, vocab_size=32000),
        ModelShape(name="llama3-8b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                   kv_channels=128, ffn_hidden_size=14336, vocab_size=128256, rotary_base=500000),
        ModelShape(name="llama3-70b", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                   kv_channels=128, ffn_hidden_size=28672, vocab_size=128256, rotary_base=500000),
        ModelShape(name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                   kv_channels=128, ffn_hidden_size=14336, vocab_size=32000, rotary_base=1000000,
                   num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336),
        ModelShape(name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_attention_heads=16,
                   num_query_groups=16, kv_channels=128, ffn_hidden_size=10944, vocab_size=102400,
                   num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                   moe_shared_expert_intermediate_size=2816, moe_first_dense_layers=1,
                   multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
                   qk_pos_emb_head_dim=64, v_head_dim=128),
    )
}

GPUS: dict[str, Hardware] = {
    g.name: g
    for g in (
        Hardware(name="h100", memory_gib=79.6, bf16_tflops=989, intra_node_gbps=450, inter_node_gbps=50,
                 host_gbps=55, fp8_tflops=1979, family="hopper", host_memory_gib=2048),
        Hardware(name="h200", memory_gib=140.4, bf16_tflops=989, intra_node_gbps=450, inter_node_gbps=50,
                 host_gbps=55, fp8_tflops=1979, family="hopper", host_memory_gib=2048),
        Hardware(name="b200", memory_gib=178.4, bf16_tflops=2250, intra_node_gbps=900, inter_node_gbps=50,
                 host_gbps=55, fp8_tflops=4500, family="blackwell", host_memory_gib=2048),
        Hardware(name="a100", memory_gib=79.2, bf16_tflops=312, intra_node_gbps=300, inter_node_gbps=25,
                 host_gbps=25, fp8_tflops=0, family="ampere", host_memory_gib=1024),
    )
}


def _preset(table: dict, name: str, flag: str, otherwise: str):
    key = name.lower()
    if key not in table:
        raise ValueError(f"{flag} {name!r}: unknown preset; choose one of {', '.join(table)} or {otherwise}")
    return table[key]


def model(name: str) -> ModelShape:
    """A preset model by name (``llama2-7b``, ``llama3-8b``, ``llama3-70b``, ``mixtral-8x7b``, ``deepseek-v2-lite``)."""
    return _preset(MODELS, name, "--model", "give the shape with --num-layers/--hidden-size/... and --model custom")


def gpu(name: str) -> Hardware:
    """A preset GPU by name (``h100``, ``h200``, ``b200``, ``a100``)."""
    return _preset(GPUS, name, "--gpu", "give --gpu-memory-gib/--bf16-tflops/... yourself")
