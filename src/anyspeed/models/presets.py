"""Model presets: the architecture of published LLM families as Megatron-LM flags.

``--model NAME`` fills the architecture flags of a LLaMA-2/3/3.1, Qwen2/2.5, Qwen3 (dense) or
Mistral model; flags given explicitly on the command line override the preset. Each preset also
knows its Hugging Face ``config.json`` fields (``hf_config``), which the checkpoint converter and
the tests use. ``tiny-<family>`` presets keep every architectural trait of the family at a size
that trains on a laptop CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    """One model architecture, in Megatron's vocabulary."""

    name: str
    family: str  # "llama" | "qwen2" | "qwen3" | "mistral" (the HF model_type)
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_epsilon: float
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def megatron_args(self) -> list[str]:
        """The Megatron-LM / MindSpeed-LLM command-line flags that describe this model."""
        args = [
            "--num-layers", str(self.num_layers),
            "--hidden-size", str(self.hidden_size),
            "--ffn-hidden-size", str(self.ffn_hidden_size),
            "--num-attention-heads", str(self.num_attention_heads),
            "--max-position-embeddings", str(self.max_position_embeddings),
            "--position-embedding-type", "rope",
            "--rotary-base", str(int(self.rotary_base)),
            "--normalization", "RMSNorm",
            "--norm-epsilon", str(self.norm_epsilon),
            "--swiglu",
            "--disable-bias-linear",
            "--padded-vocab-size", str(self.vocab_size),
        ]  # fmt: skip
        if self.num_query_groups != self.num_attention_heads:
            args += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.kv_channels:
            args += ["--kv-channels", str(self.kv_channels)]
        if self.add_qkv_bias:
            args.append("--add-qkv-bias")
        if self.qk_layernorm:
            args.append("--qk-layernorm")
        if not self.tie_embeddings:
            args.append("--untie-embeddings-and-output-weights")
        if self.rope_scaling:
            args += ["--use-rope-scaling",
                     "--rope-scaling-factor", str(self.rope_scaling["factor"])]  # fmt: skip
        return args

    def hf_config(self) -> dict[str, Any]:
        """Fields of the family's Hugging Face ``config.json`` for this architecture."""
        cfg: dict[str, Any] = {
            "model_type": self.family,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rotary_base,
            "rms_norm_eps": self.norm_epsilon,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
        }
        if self.kv_channels or self.family in ("qwen3", "mistral"):
            cfg["head_dim"] = self.head_dim
        if self.family == "llama":
            cfg["attention_bias"] = self.add_qkv_bias
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    def num_parameters(self) -> int:
        """Parameter count of the model (embeddings included, tied ones counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h
        if self.add_qkv_bias:
            attn += q + 2 * kv
        if self.qk_layernorm:
            attn += 2 * d
        layer = attn + 3 * h * self.ffn_hidden_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h


def _llama(name, layers, h, ffn, heads, groups, vocab=32000, maxpos=4096, base=10000.0,
           scaling=None) -> ModelPreset:  # fmt: skip
    return ModelPreset(name, "llama", layers, h, ffn, heads, groups, vocab, maxpos, base, 1e-5,
                       rope_scaling=scaling)  # fmt: skip


_LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def _qwen2(name, layers, h, ffn, heads, groups, vocab=151936, maxpos=32768, tie=False,
           base=1000000.0) -> ModelPreset:  # fmt: skip
    return ModelPreset(name, "qwen2", layers, h, ffn, heads, groups, vocab, maxpos, base, 1e-6,
                       add_qkv_bias=True, tie_embeddings=tie)  # fmt: skip


def _qwen3(name, layers, h, ffn, heads, groups, tie=False) -> ModelPreset:
    return ModelPreset(name, "qwen3", layers, h, ffn, heads, groups, 151936, 40960, 1000000.0,
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
    ModelPreset("mistral-7b", "mistral", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, 1e-5),
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
PRESETS: dict[str, ModelPreset] = {p.name: p for p in _ALL}
PRESETS.update({name: replace(p, name=name) for name, p in _TINY.items()})


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive); a clear error lists the choices."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"--model {name}: unknown preset (choose from {', '.join(PRESETS)})")
    return PRESETS[key]


def apply_preset(argv: list[str]) -> list[str]:
    """Expand ``--model NAME`` in ``argv`` into the preset's flags; explicit flags win."""
    if "--model" not in argv and not any(a.startswith("--model=") for a in argv):
        return list(argv)
    out, name, i = [], None, 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--model" and i + 1 < len(argv):
            name, i = argv[i + 1], i + 2
            continue
        if tok.startswith("--model="):
            name, i = tok.split("=", 1)[1], i + 1
            continue
        out.append(tok)
        i += 1
    if name is None:
        raise ValueError("--model needs a preset name")
    return merge_flags(get_preset(name).megatron_args(), out)


def merge_flags(defaults: list[str], argv: list[str]) -> list[str]:
    """``defaults`` (flags with optional values) then ``argv``, dropping defaults ``argv`` sets."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    j, kept = 0, []
    while j < len(defaults):
        flag = defaults[j]
        has_value = j + 1 < len(defaults) and not defaults[j + 1].startswith("--")
        if flag not in given:
            kept += defaults[j : j + (2 if has_value else 1)]
        j += 2 if has_value else 1
    return kept + list(argv)


# ------------------------------------------------------------------------------------------------
# Hugging Face config.json -> preset (the converter and `pretrain --load <hf dir>` use this)

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Megatron's RotaryEmbedding applies LLaMA-3 scaling with only the factor configurable.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}  # fmt: skip


def hf_family(config: dict[str, Any]) -> str:
    """The family (HF ``model_type``) of an HF ``config.json``; ValueError lists the supported."""
    archs = config.get("architectures") or []
    by_arch = {arch: fam for fam, arch in HF_ARCHITECTURES.items()}
    family = by_arch.get(archs[0]) if archs else config.get("model_type")
    if family not in HF_ARCHITECTURES or (archs and len(set(archs)) > 1):
        got = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {got}; supported: "
                         f"{', '.join(sorted(HF_ARCHITECTURES.values()))}")  # fmt: skip
    return family


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope base, llama3 scaling or None) from either ``rope_scaling`` + ``rope_theta``
    (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    base = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return base, None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (only llama3)")
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if float(scaling.get(key, want)) != want:
            raise ValueError(f"llama3 rope scaling {key}={scaling[key]} is not supported "
                             f"(Megatron fixes it to {want})")  # fmt: skip
    keep = ("rope_type", "factor", *_MEGATRON_LLAMA3_ROPE)
    return base, {k: scaling[k] for k in keep if k in scaling}


def preset_from_hf(config: dict[str, Any], name: str | None = None) -> ModelPreset:
    """The preset an HF ``config.json`` (as a dict) describes; ValueError (one line) when
    Megatron's GPTModel cannot express it."""
    family = hf_family(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if family != "qwen2" and config.get("attention_bias"):  # it adds an o_proj bias too
        raise ValueError("attention_bias=true is not supported")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    explicit = head_dim and (family == "qwen3" or int(head_dim) != hidden // heads)
    base, scaling = _hf_rope(config)
    return ModelPreset(
        name=name or f"hf-{family}",
        family=family,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rotary_base=base,
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        kv_channels=int(head_dim) if explicit else None,
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family == "qwen3",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )
