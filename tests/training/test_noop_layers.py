"""MindSpeed's ``--noop-layers``: empty layer slots, counted in ``--num-layers``, that move the
pipeline's stage boundaries and compute nothing.

The placement is checked against plain list arithmetic (cut the slots into stages, drop the
noop ones) and against Megatron's own offset and layer-count functions as the adaptor patches
them; training with noop slots is checked against one process of the real layers from the same
weights (fp32, 1e-5), and its checkpoint against that process's logits, bit for bit: the real
layers keep their numbers, so a checkpoint does not depend on the slots.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from anyspeed.layout import Layout
from anyspeed.testing import run_distributed
from helpers import trainer_ranks

RTOL = 1e-5


def _reference_split(slots: int, stages: int, noop: tuple[int, ...]) -> list[list[int]]:
    """Each stage's real layers (global numbers), from the slots cut into equal stages."""
    per = slots // stages
    real_number = {s: i for i, s in enumerate(s for s in range(slots) if s not in noop)}
    return [[real_number[s] for s in range(k * per, (k + 1) * per) if s not in noop]
            for k in range(stages)]  # fmt: skip


PLACEMENTS = [  # layout, real layers
    (dict(pp=8, noop_layers=(61, 62, 63)), 61),  # DeepSeek-V3 on 8 stages
    (dict(pp=4, noop_layers=(0, 15)), 14),  # MindSpeed's doc: one empty slot at each end
    (dict(pp=2, vpp=2, noop_layers=(0, 5)), 6),
    (dict(pp=2, noop_layers=(2, 3)), 2),  # a stage of noop slots only
    (dict(pp=2, dualpipev=True, noop_layers=(1, 6)), 6),
]


@pytest.mark.parametrize("layout,real", PLACEMENTS)
def test_placement_is_the_slots_without_the_noop_ones(layout, real):
    lay = Layout(**layout)
    slots = real + len(lay.noop_layers)
    stages = 2 * lay.pp if lay.dualpipev else lay.pp * lay.chunks
    want = _reference_split(slots, stages, lay.noop_layers)
    for rank in range(lay.pp):
        got = [list(r) for r in lay.chunk_layers(real, rank)]
        assert got == [want[lay.stage_of(rank, c)] for c in range(lay.chunks)]
    assert sum(lay.stage_layers(real)) == real


@pytest.mark.parametrize("layout,real", PLACEMENTS)
def test_megatrons_placement_functions_follow(layout, real):
    """Megatron's get_transformer_layer_offset / get_num_layers_to_build (what its blocks and
    layers call) as the adaptor's chunk-placement patch answers them for every chunk."""
    from anyspeed import adaptor
    from anyspeed.models import ModelConfig
    from anyspeed.models.gpt import transformer_config

    lay = Layout(**layout)
    adaptor.apply(argv=[])
    try:
        from megatron.core.transformer import transformer_block, transformer_layer

        cfg = transformer_config(ModelConfig(num_layers=real, hidden_size=8,
                                             num_attention_heads=1), lay)  # fmt: skip
        for rank in range(lay.pp):
            for chunk, layers in enumerate(lay.chunk_layers(real, rank)):
                vp = chunk if lay.vpp else None
                got_offset = transformer_layer.get_transformer_layer_offset(cfg, vp, rank)
                got_count = transformer_block.get_num_layers_to_build(cfg, vp, rank)
                assert (got_offset, got_count) == (layers.start, len(layers))
    finally:
        adaptor.undo()


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(noop_layers="1,x"), "give 0-based layer indices"),
        (dict(noop_layers="1,1"), "names a layer twice"),
        (dict(noop_layers="4"), "numbered 0 to 3"),
        (dict(noop_layers="0,1,2,3"), "leaves no real layer"),
        (dict(noop_layers="3", num_layer_list="2,2"), "--num-layer-list both place layers"),
        (dict(noop_layers="3", num_layers=5), "--num-layers 5 is not divisible"),
    ],
)
def test_bad_noop_flags_are_one_line(flags, message):
    from anyspeed.device import detect
    from anyspeed.features import registry
    from anyspeed.features.base import FeatureError

    args = argparse.Namespace(**{"pipeline_model_parallel_size": 2, "num_layers": 4, **flags})
    with pytest.raises((FeatureError, ValueError), match=message):
        registry.get("noop-layers").validate(args, detect())
        Layout.from_args(args).validate(2, num_layers=args.num_layers)


def test_rewrite_gives_the_real_layers_once():
    from anyspeed.device import detect
    from anyspeed.features import registry

    args = argparse.Namespace(pipeline_model_parallel_size=8, num_layers=64, noop_layers="63,61,62")
    for _ in range(2):  # a second validation leaves the rewritten namespace alone
        registry.get("noop-layers").validate(args, detect())
    assert (args.num_layers, args.noop_layers) == (61, (61, 62, 63))
    assert Layout.from_args(args).stage_layers(61) == [8] * 7 + [5]


def test_a_preset_gets_its_layers_plus_the_noop_slots():
    from anyspeed.stages.arguments import parse_pretrain_args

    base = ["--model", "tiny-qwen2.5", "--seq-length", "32", "--lr", "1e-3"]
    args = parse_pretrain_args([*base, "--noop-layers", "2,3"])
    assert args.num_layers == 2 + 2  # the preset's 2 layers, then 2 noop slots
    args = parse_pretrain_args([*base, "--num-layers", "6", "--noop-layers", "5"])
    assert args.num_layers == 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process of 3 real layers: its initial weights, 3 steps, eval and logits."""
    root = tmp_path_factory.mktemp("noop")
    init, tokens, ref = trainer_ranks.one_process_reference(root, 3)
    return root, init, tokens, ref


def _assert_parity(ref: dict, got: dict) -> None:
    for i, (r, g) in enumerate(zip(ref["steps"], got["steps"], strict=True)):
        assert g["ok"], f"step {i}: optimizer step skipped"
        for key in ("loss", "grad_norm"):
            assert math.isfinite(g[key])
            assert g[key] == pytest.approx(r[key], rel=RTOL), f"step {i} {key}"
    assert len({round(s["loss"], 9) for s in ref["steps"]}) > 1  # training moved
    assert got["eval"] == pytest.approx(ref["eval"], rel=RTOL)


def test_pp2_with_a_noop_slot_matches_one_process(reference):
    """3 real layers as 4 slots at PP 2 (slot 3 empty: stages of 2 and 1 real layers)."""
    root, init, tokens, ref = reference
    saved = str(root / "noop")
    got = run_distributed(trainer_ranks.train_eval_save_logits, 2,
                          layout=dict(pp=2, noop_layers=(3,)), load=init, save=saved,
                          tokens=tokens, spec=dict(num_layers=3), timeout=300)  # fmt: skip
    for rank_result in got:
        _assert_parity(ref, rank_result)
    assert got[0]["logits"] is None
    torch.testing.assert_close(got[1]["logits"], ref["logits"], rtol=0, atol=1e-5)
    (single,) = run_distributed(trainer_ranks.load_logits, 1, layout={}, load=saved,
                                tokens=tokens, spec=dict(num_layers=3))  # fmt: skip
    assert torch.equal(got[1]["logits"], single)


SLOW_LAYOUTS = {
    # a last stage of noop slots only: rank 1 holds the final norm and the output layer
    "pp2-empty-stage": dict(pp=2, noop_layers=(3, 4, 5)),
    "pp2-vpp2": dict(pp=2, vpp=2, noop_layers=(2,)),  # rank 0's second chunk empty
    # stage 3, rank 0's second chunk beside the loss, empty
    "pp2-dualpipev": dict(pp=2, dualpipev=True, dualpipev_dw_detach=True, noop_layers=(3,)),
    "tp2-pp2": dict(tp=2, pp=2, noop_layers=(1,)),
}


@pytest.mark.slow  # 2 or 4 processes each
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_layouts_with_noop_slots_match_one_process(reference, name):
    root, init, tokens, ref = reference
    layout = SLOW_LAYOUTS[name]
    world = 2 * layout.get("tp", 1)
    vpp = bool(layout.get("vpp"))  # (a logits pass is one micro-batch: interleaving needs PP)
    got = run_distributed(trainer_ranks.train_eval_save_logits, world, layout=layout,
                          load=init, save=str(root / name), tokens=None if vpp else tokens,
                          spec=dict(num_layers=3), timeout=600)  # fmt: skip
    for rank_result in got:
        _assert_parity(ref, rank_result)
    out = [r["logits"] for r in got if r["logits"] is not None]
    if not vpp:
        torch.testing.assert_close(out[0], ref["logits"], rtol=0, atol=3e-5)


def test_legacy_conversion_with_noop_slots_round_trips(tmp_path):
    """HF -> legacy Megatron at PP 2 with MindSpeed-LLM's --noop-layers (3 layers as 4 slots,
    slot 0 empty: stages of 1 and 2 real layers, each numbered from 0 in its rank file) ->
    HF, bit for bit; a slot beyond the model's layers plus the slots is a one-line error."""
    from anyspeed.convert import ConvertError, hf_to_megatron
    from helpers.convert_ranks import legacy_round_trip

    legacy_round_trip(tmp_path, 3, 2, [1, 2], noop_layers="0")
    with pytest.raises(ConvertError, match="numbered 0 to 3"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "bad", pp=2, ckpt_format="legacy",
                       noop_layers="4")  # fmt: skip


def test_a_frozen_model_of_another_depth_splits_without_the_slots():
    """A reward model or teacher of 4 layers beside a policy of 3 real layers in 4 slots: the
    slots are the policy's, so the other model splits 2 + 2 (with them: 5 slots, no split)."""
    from anyspeed.errors import UsageError
    from anyspeed.models import ModelConfig
    from anyspeed.stages.common.rl.reward_layout import check_fits_layout

    args = argparse.Namespace(pipeline_model_parallel_size=2, num_layers=3, noop_layers=(3,))
    check_fits_layout(args, ModelConfig(num_layers=4), 2)
    check_fits_layout(args, ModelConfig(num_layers=3), 2)  # the policy's depth: its slots
    with pytest.raises(UsageError, match="not divisible"):
        check_fits_layout(args, ModelConfig(num_layers=5), 2)
    lay = Layout(pp=2, noop_layers=(3,))
    assert lay.for_other_model().stage_layers(4) == [2, 2] and lay.stage_layers(3) == [2, 1]
