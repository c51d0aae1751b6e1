"""Functions spawned ranks run for the Qwen-VL tests."""

from __future__ import annotations


def qwen_vl_logits(state: dict, config_json: dict, tp: int, inputs: dict) -> dict:
    """This TP rank's vocabulary slice of the logits of the converted Qwen-VL ``state``."""
    import torch

    model = _model(state, config_json, tp)
    with torch.no_grad():
        return {"logits": model(**inputs)}


def qwen_vl_generate(
    state: dict, config_json: dict, tp: int, inputs: dict, n: int, cache: bool = True, pad=None,
    pp: int = 1,
) -> dict:  # fmt: skip
    """``n`` greedy tokens of the converted Qwen-VL ``state`` at TP ``tp`` x PP ``pp``."""
    from anyspeed.inference.qwen_vl import generate

    model = _model(state, config_json, tp, pp)
    ids = inputs.pop("input_ids")
    vocab = config_json["text_config"]["vocab_size"]
    vision = [config_json[k] for k in ("image_token_id", "video_token_id",
                                       "vision_start_token_id", "vision_end_token_id")]  # fmt: skip

    def pick(logits):  # greedy, never a vision token (as the reference)
        logits[:, vision] = -float("inf")
        return logits.argmax(-1)

    out = generate(model, ids, inputs, n, vocab, pick=pick, use_kv_cache=cache, pad=pad)
    return {"tokens": out}


def _model(state: dict, config_json: dict, tp: int, pp: int = 1):
    """This rank's QwenVLModel (TP shard, pipeline stage) of the converted ``state`` (eval)."""
    import functools

    from megatron.core import parallel_state as ps

    from anyspeed.convert.llava import load_into
    from anyspeed.convert.qwen_vl import language_preset, shard
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.qwen_vl.model import QwenVLModel
    from anyspeed.models.qwen_vl.positions import VisionTokens
    from anyspeed.models.qwen_vl.tower import tower_from_hf, tower_transformer_config

    layout = Layout(tp=tp, pp=pp)
    init_distributed(layout, seed=0)
    tower, preset = tower_from_hf(config_json["vision_config"]), language_preset(config_json)
    seconds = config_json["vision_config"].get("tokens_per_second")
    tokens = VisionTokens(config_json["image_token_id"], config_json["video_token_id"], 2,
                          seconds if tower.kind == "qwen2_5_vl" else None)  # fmt: skip
    model = QwenVLModel(tower, tower_transformer_config(tower, layout), preset,
                        gpt.transformer_config(preset, layout), tokens,
                        pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage()).eval()  # fmt: skip
    split = functools.partial(shard, gated=tower.kind == "qwen2_5_vl")
    load_into(model, state, tp, ps.get_tensor_model_parallel_rank(), split)  # every tensor
    return model


def vlm_tower(cli: list[str]) -> dict:
    """Train ``anyspeed posttrain --stage vlm`` (Qwen-VL) here; the tower's weights after."""
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    run, _ = prepare(cli, command="posttrain")
    model = train(run, task_for(run))["trainer"].model[0].module
    state = model.vision.state_dict()
    return {k: v.detach().clone() for k, v in state.items() if not k.endswith("_extra_state")}


def lora_logits(cli: list[str], inputs: dict) -> dict:
    """Train ``anyspeed posttrain --stage vlm`` with LoRA here; the trained model's logits of
    ``inputs`` (adapters on)."""
    import torch

    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    run, _ = prepare(cli, command="posttrain")
    model = train(run, task_for(run))["trainer"].model[0].module.eval()
    with torch.no_grad():
        return {"logits": model(**inputs)}
