"""Model presets: the architecture of published LLM families as Megatron-LM flags.

``--model NAME`` fills the architecture flags of a LLaMA-2/3/3.1, Qwen2/2.5, Qwen3 (dense) or
Mistral model; flags given explicitly on the command line override the preset. Each preset also
knows its Hugging Face ``config.json`` fields (``hf_config``), which the checkpoint converter and
the tests use. ``tiny-<family>`` presets keep every architectural trait of the family at a size
that trains on a laptop CPU.
"""

from __future__ import annotations

from dataclasses import replace

from anyspeed.argv import merge_flags, pop_flag
from anyspeed.models.config import ModelConfig
from anyspeed.models.hf import HF_ARCHITECTURES, hf_family, preset_from_hf  # noqa: F401

ModelPreset = ModelConfig  # the former name of the one model type


def _llama(name, layers, h, ffn, heads, groups, vocab=32000, maxpos=4096, base=10000.0,
           scaling=None) -> ModelConfig:  # fmt: skip
    return ModelConfig(name, "llama", layers, h, ffn, heads, groups, vocab, maxpos, base, 1e-5,
                       rope_scaling=scaling)  # fmt: skip


_LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def _qwen2(name, layers, h, ffn, heads, groups, vocab=151936, maxpos=32768, tie=False,
           base=1000000.0) -> ModelConfig:  # fmt: skip
    return ModelConfig(name, "qwen2", layers, h, ffn, heads, groups, vocab, maxpos, base, 1e-6,
                       add_qkv_bias=True, tie_embeddings=tie)  # fmt: skip


def _qwen3(name, layers, h, ffn, heads, groups, tie=False) -> ModelConfig:
    return ModelConfig(name, "qwen3", layers, h, ffn, heads, groups, 151936, 40960, 1000000.0,
                       1e-6, kv_channels=128, qk_layernorm=True, tie_embeddings=tie)  # fmt: skip


_ALL = [
    _llama("llama2-7b", 32, 4096, 11008, 32, 32),
    _llama("llama2-13b", 40, 5120, 13824, 40, 40),
    _llama("llama2-70b", 80, 8192, 28672, 64, 8),
    _llama("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
    _llama("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, 500000.0),
    _llama("llama3.1-8b", 32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, _LLAMA31_SCALING),
    _llama("llama3.1-70b", 80, 8192, 28672, 64, 8, 128256, 131072, 500000.0, _LLAMA31_SCALING),
    _qwen2("qwen2-0.5b", 24, 896, 4864, 14, 2, maxpos=131072, tie=True),
    _qwen2("qwen2-1.5b", 28, 1536, 8960, 12, 2, maxpos=131072, tie=True),
    _qwen2("qwen2-7b", 28, 3584, 18944, 28, 4, vocab=152064, maxpos=131072),
    _qwen2("qwen2-72b", 80, 8192, 29568, 64, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-0.5b", 24, 896, 4864, 14, 2, tie=True),
    _qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, tie=True),
    _qwen2("qwen2.5-3b", 36, 2048, 11008, 16, 2, tie=True),
    _qwen2("qwen2.5-7b", 28, 3584, 18944, 28, 4, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-14b", 48, 5120, 13824, 40, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-32b", 64, 5120, 27648, 40, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-72b", 80, 8192, 29568, 64, 8, vocab=152064, maxpos=131072),
    _qwen3("qwen3-0.6b", 28, 1024, 3072, 16, 8, tie=True),
    _qwen3("qwen3-1.7b", 28, 2048, 6144, 16, 8, tie=True),
    _qwen3("qwen3-4b", 36, 2560, 9728, 32, 8, tie=True),
    _qwen3("qwen3-8b", 36, 4096, 12288, 32, 8),
    _qwen3("qwen3-14b", 40, 5120, 17408, 40, 8),
    _qwen3("qwen3-32b", 64, 5120, 25600, 64, 8),
    ModelConfig("mistral-7b", "mistral", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, 1e-5),
]
# Tiny variants: the family's traits (GQA, biases, QK norm, head_dim, tying, rope scaling) at
# a size a CPU trains in seconds.
_TINY = {
    "tiny-llama2": replace(_ALL[0], num_layers=2, hidden_size=64, ffn_hidden_size=176,
                           num_attention_heads=4, num_query_groups=4, vocab_size=512),
    "tiny-llama3": replace(_ALL[5], num_layers=2, hidden_size=64, ffn_hidden_size=176,
                           num_attention_heads=4, num_query_groups=2, vocab_size=512,
                           max_position_embeddings=512),
    "tiny-qwen2.5": replace(_ALL[11], num_layers=2, hidden_size=64, ffn_hidden_size=176,
                            num_attention_heads=4, num_query_groups=2, vocab_size=512),
    "tiny-qwen3": replace(_ALL[18], num_layers=2, hidden_size=64, ffn_hidden_size=176,
                          num_attention_heads=4, num_query_groups=2, vocab_size=512,
                          kv_channels=32),
    "tiny-mistral": replace(_ALL[-1], num_layers=2, hidden_size=64, ffn_hidden_size=176,
                            num_attention_heads=4, num_query_groups=2, vocab_size=512),
}  # fmt: skip
PRESETS: dict[str, ModelConfig] = {p.name: p for p in _ALL}
PRESETS.update({name: replace(p, name=name) for name, p in _TINY.items()})


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive); a clear error lists the choices."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"--model {name}: unknown preset (choose from {', '.join(PRESETS)})")
    return PRESETS[key]


def apply_preset(argv: list[str]) -> list[str]:
    """Expand ``--model NAME`` in ``argv`` into the preset's flags; explicit flags win."""
    name, rest = pop_flag(argv, "--model")
    if name is None:
        return list(argv)
    return merge_flags(get_preset(name).megatron_args(), rest)
