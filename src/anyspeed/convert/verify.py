"""``--verify``: the converted pair on the same random tokens, max-abs logits difference (fp32);
a reward model's per-token scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from anyspeed.checkpoint.reads import checkpoint_dir, checkpoint_format, read_common
from anyspeed.checkpoint.record import read_model
from anyspeed.convert import engine
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.megatron_io import (
    empty_model,
    legacy_expert_parallel,
    megatron_session,
    read_legacy,
)
from anyspeed.convert.reward import is_reward_model, reward_mapping
from anyspeed.convert.torch_dist import read_torch_dist
from anyspeed.models.families import mapping_for
from anyspeed.models.reward_head import reward_head


def megatron_logits(mg_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, padded vocab] of Megatron's GPTModel (TP1/PP1, fp32) from a checkpoint of
    either layout."""
    preset = read_model(mg_dir)
    m = mapping_for(preset.family)
    it_dir = checkpoint_dir(mg_dir)
    reward = is_reward_model(read_common(it_dir))
    with megatron_session():
        model = empty_model(preset, torch.float32)
        if reward:  # per-token scores [b, s, 1] of the reward head
            m = reward_mapping(m)
            model = reward_head(model, preset)
        if checkpoint_format(it_dir) == "torch_dist":
            groups = read_torch_dist(
                it_dir, preset, lambda g: list(engine.entries(m, preset, g)), engine.groups(preset)
            )
        else:
            groups = read_legacy(it_dir, legacy_expert_parallel(read_common(it_dir)), preset)
        state = {
            k: engine.materialize(v).float() for _, tensors in groups for k, v in tensors.items()
        }
        if preset.tie_embeddings:
            state.pop("output_layer.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ConvertError(f"{mg_dir}: missing {missing[:3]} unexpected {unexpected[:3]}")
        model.eval()
        pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        with torch.no_grad():
            return model(tokens, pos, None).float()


def _has_experts(config) -> bool:
    return any(getattr(config, k, None) for k in ("num_experts", "num_local_experts"))


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the ``transformers`` model of ``hf_dir`` in fp32.

    Built with ``from_config`` and a strict load of the safetensors files rather than
    ``from_pretrained``, whose meta-device initialisation of non-persistent buffers (RoPE
    frequencies) goes wrong once anyspeed's device layer is applied in the process.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from anyspeed.convert.hf_io import TEXT_MODEL_OF, HFCheckpoint

    ck = HFCheckpoint(hf_dir)
    config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    if ck.vlm is not None:  # a vision-language checkpoint: its text model, as it is converted
        config = config.get_text_config()
        config.architectures = [TEXT_MODEL_OF[ck.vlm]]
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or ()):
        return _hf_token_scores(AutoModelForSequenceClassification, config, ck, tokens)
    if _has_experts(config) and ck.vlm is None:  # transformers fuses the files' experts itself
        model, info = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=torch.float32, local_files_only=True, output_loading_info=True
        )
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = {n: ck.get(n).float() for n in ck.names}
        missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    # multi-token prediction layers (after the last decoder layer): transformers has none
    m, n = mapping_for(config.model_type), config.num_hidden_layers
    unexpected = [k for k in unexpected if not engine.hf_layer_at_least(m, k, n)]
    missing, unexpected = sorted(missing), sorted(unexpected)
    if missing or unexpected:
        raise ConvertError(
            f"{hf_dir}: transformers misses {missing[:3]}, does not expect {unexpected[:3]}"
        )
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _hf_token_scores(auto: Any, config: Any, ck: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A sequence-classification model's head at every position, [b, s, labels] (its own
    output is the last non-pad token's row of this)."""
    model = auto.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {n: ck.get(n).float() for n in ck.names}, strict=False
    )
    if missing or unexpected:
        raise ConvertError(f"transformers misses {missing[:3]}, does not expect {unexpected[:3]}")
    model.eval()
    with torch.no_grad():
        hidden = model.base_model(tokens).last_hidden_state
        return model.score(hidden).float()


def verify(
    hf_dir: str | Path,
    mg_dir: str | Path,
    *,
    tolerance: float = 1e-4,
    seq_length: int = 32,
    seed: int = 0,
) -> float:
    """Max-abs logits difference of the two checkpoints; ConvertError above ``tolerance``."""
    from anyspeed.convert.hf_io import read_config

    vocab = int(read_config(hf_dir)["vocab_size"])
    tokens = torch.randint(0, vocab, (2, seq_length), generator=torch.Generator().manual_seed(seed))
    ref = hf_logits(hf_dir, tokens)
    got = megatron_logits(mg_dir, tokens)[..., :vocab]
    diff = float((ref - got).abs().max())
    if not diff <= tolerance:
        raise ConvertError(f"--verify: max-abs logits difference {diff:.3g} exceeds {tolerance:g}")
    return diff
