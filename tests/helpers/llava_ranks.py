"""Functions spawned ranks run for the multimodal tests."""

from __future__ import annotations


def llava_logits(state: dict, config_json: dict, tp: int, images, ids) -> dict:
    """This TP rank's vocabulary slice of the logits of the converted LLaVA ``state``."""
    import torch
    from megatron.core import parallel_state as ps

    from anyspeed.convert import llava as conv
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout
    from anyspeed.models import gpt, multimodal
    from anyspeed.models.vision import llava_from_hf

    layout = Layout(tp=tp)
    init_distributed(layout, seed=0)
    cfg = llava_from_hf(config_json)
    model = multimodal.build_llava(cfg, gpt.transformer_config(cfg.language, layout), layout)
    conv.load_into(model.eval(), state, tp, ps.get_tensor_model_parallel_rank())
    with torch.no_grad():
        out, _ = model(images, ids, None, None)
    return {"logits": out}


def vlm_weights(cli: list[str]) -> dict:
    """Train ``anyspeed posttrain --stage vlm`` here; the tower's and projector's weights."""
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    run, _ = prepare(cli, command="posttrain")
    model = train(run, task_for(run))["trainer"].model[0].module

    def grab(m):
        return {k: v.detach().clone() for k, v in m.state_dict().items()
                if not k.endswith("_extra_state")}  # fmt: skip

    return {"vision": grab(model.vision_model), "projector": grab(model.vision_projection)}
