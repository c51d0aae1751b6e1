"""``anyspeed fsdp2`` on vision-language models (tiny random Qwen2.5-VL and Qwen3-VL, the
latter with no Megatron version in anyspeed): the conversation file's rendering checked against
the image processor and the answers, DP2 against a one-process transformers loop, and a frozen
tower that stays bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import fsdp_ranks as R
from helpers import fsdp_vlm as V

LR, WD, CLIP = 1e-3, 0.1, 1.0


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hf_tok: str
) -> tuple[str, str]:
    root = tmp_path_factory.mktemp(request.param)
    make = V.qwen25_vl if request.param == "qwen2_5_vl" else V.qwen3_vl
    model_dir = make(root / "model", hf_tok)
    (root / "data").mkdir()
    return model_dir, V.conversations(root / "data", n=12)


def test_conversations_render_as_the_processor_says(vlm: tuple[str, str]) -> None:
    """Each image becomes grid/4 image tokens (the image processor's own grid); only the
    answers (and their end marker) are learned."""
    import json
    import os

    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from anyspeed.fsdp.mm_data import ConversationSource

    model_dir, data = vlm
    src = ConversationSource(data, 256, model_dir, "", 10**8)
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        proc = AutoImageProcessor.from_pretrained(model_dir)
    except ImportError:  # transformers 5.17's Auto class needs torchvision; its PIL one not
        import transformers

        proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    records = json.loads(open(data).read())
    for i, record in enumerate(records):
        s = src[i]
        files = [os.path.join(os.path.dirname(data), f) for f in record.get("images", [])]
        want = 0
        for f in files:
            grid = proc(images=[Image.open(f).convert("RGB")], return_tensors="pt")[
                "image_grid_thw"
            ]
            want += int(grid.prod()) // 4
        assert s.input_ids.count(pad) == want
        learned = tok.decode([t for t in s.targets if t != -100])
        assert learned.strip() == record["messages"][-1]["content"] + "<|im_end|>"


def _batches(model_dir: str, data: str, gbs: int, steps: int) -> list[dict]:
    from anyspeed.fsdp.mm_data import ConversationSource
    from anyspeed.fsdp.samples import collate

    src = ConversationSource(data, 256, model_dir, "", 10**8)
    return [collate([src[k * gbs + j] for j in range(gbs)], 1) for k in range(steps)]


def test_dp2_equals_one_process_and_frozen_tower(tmp_path, vlm: tuple[str, str]) -> None:
    model_dir, data = vlm
    out = tmp_path / "out"
    cfg = R.write_config(
        tmp_path / "c.yaml",
        model_dir,
        data,
        model={"freeze": ["model.visual"]},
        data={"cutoff_len": 256},
        training={"output_dir": str(out), "save_hf_weights": True, "max_steps": 3},
    )
    ranks = run_distributed(R.train_rank, 2, config=cfg, timeout=240)
    batches = _batches(model_dir, data, 4, 3)
    ref = R.reference_loop(model_dir, batches, LR, WD, CLIP, freeze="model.visual")
    np.testing.assert_allclose(ranks[0]["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ranks[0]["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=1e-6)
    trained, start = R.load_params(str(out / "hf")), R.load_params(model_dir)
    worst = max((trained[k] - ref["params"][k]).abs().max().item() for k in trained)
    assert worst < 1e-5
    for k in trained:
        if k.startswith("model.visual."):
            assert torch.equal(trained[k], start[k]), k
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])


def test_an_image_processor_that_needs_torchvision_falls_back_to_pil(vlm: tuple[str, str]):
    """transformers 5.17's ``AutoImageProcessor`` needs torchvision; the PIL processor reads the
    same settings. Any other import failure is one line naming the fix."""
    import transformers

    from anyspeed.errors import UsageError
    from anyspeed.fsdp.mm_data import _image_processor

    model_dir, _ = vlm

    class NeedsTorchvision:
        @staticmethod
        def from_pretrained(_: str) -> None:
            raise ImportError("\nAutoImageProcessor requires the Torchvision library but ...")

    proc = _image_processor(NeedsTorchvision, model_dir)
    assert isinstance(proc, transformers.Qwen2VLImageProcessorPil)
    assert (
        proc.merge_size
        == transformers.AutoConfig.from_pretrained(model_dir).vision_config.spatial_merge_size
    )

    class Broken:
        @staticmethod
        def from_pretrained(_: str) -> None:
            raise ImportError("No module named 'pillow_heif'")

    with pytest.raises(
        UsageError,
        match=r"cannot load its image processor .*pillow_heif.*install the module it names",
    ) as e:
        _image_processor(Broken, model_dir)
    assert "\n" not in str(e.value)
