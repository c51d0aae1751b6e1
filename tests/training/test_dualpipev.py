"""DualPipeV (``--schedules-method dualpipev``) against a single process of the same weights.

The reference saves its initial weights with Megatron's dist_checkpointing; the V loads them,
trains 3 steps, evaluates (the forward-only plan) and saves. Losses and grad norms must match
the reference within 1e-5 relative (fp32), and the V's checkpoint must give one process the
same logits, bit for bit, that the V computes: layer numbers stay global, and the pipeline
does not change the arithmetic. The model ties its embedding and output weights, which the V
holds on one rank in two chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import trainer_ranks

RTOL = 1e-5
TIED = dict(tie_embeddings=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("dualpipev")
    init = str(root / "init")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    (ref,) = run_distributed(
        trainer_ranks.train_eval_save_logits,
        1,
        layout={},
        load=_saved_init(init),
        save=str(root / "ref"),
        tokens=tokens,
        spec=TIED,
        timeout=300,
    )
    return root, init, tokens, ref


def _saved_init(path: str) -> str:
    run_distributed(trainer_ranks.train_steps, 1, layout={}, steps=0, save_init=path,
                    spec=TIED, timeout=240)  # fmt: skip
    return path


def _assert_steps(ref: list[dict], got: list[dict]) -> None:
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert g["ok"], f"step {i}: optimizer step skipped"
        for key in ("loss", "grad_norm"):
            assert math.isfinite(g[key])
            assert g[key] == pytest.approx(r[key], rel=RTOL), f"step {i} {key}"
    assert len({round(s["loss"], 9) for s in ref}) > 1  # training moved


def _assert_parity(ref: dict, got: dict) -> None:
    _assert_steps(ref["steps"], got["steps"])
    assert got["eval"] == pytest.approx(ref["eval"], rel=RTOL)


def test_pp2_matches_one_process_and_saves_global_layers(reference):
    root, init, tokens, ref = reference
    saved = str(root / "v")
    v = run_distributed(
        trainer_ranks.train_eval_save_logits,
        2,
        layout=dict(pp=2, dualpipev=True),
        load=init,
        save=saved,
        tokens=tokens,
        spec=TIED,
        timeout=300,
    )
    for rank_result in v:  # every rank reports the same, DP-averaged numbers
        _assert_parity(ref, rank_result)
    # The output is on pipeline rank 0 (the V's tip is rank 1).
    assert v[0]["logits"] is not None and v[1]["logits"] is None
    torch.testing.assert_close(v[0]["logits"], ref["logits"], rtol=0, atol=1e-5)
    (single,) = run_distributed(
        trainer_ranks.load_logits, 1, layout={}, load=saved, tokens=tokens, spec=TIED
    )
    assert torch.equal(v[0]["logits"], single)


def test_bf16_equals_1f1b_bit_for_bit(reference):
    """bf16: the V's middle stage (the last rank's second chunk) hands bf16 on, and only
    the model's real ends cast (Megatron's wrapper cast by pipeline rank, and the last rank
    sent fp32 to a bf16 receiver). The V changes no arithmetic: equal to 1F1B's losses."""
    _, init, _, _ = reference
    one, v, split = run_distributed(
        trainer_ranks.layouts_steps,
        2,
        layouts=[dict(pp=2), dict(pp=2, dualpipev=True),
                 dict(pp=2, dualpipev=True, dualpipev_dw_detach=True)],
        load=init,
        spec=TIED,
        bf16=True,
        timeout=300,
    )[0]  # fmt: skip
    losses = [[s["loss"] for s in run] for run in (one, v, split)]
    assert losses[0] == losses[1] == losses[2]
    assert len(set(losses[0])) == 3


def test_mtp_beside_the_loss_equals_one_process(tmp_path):
    """Multi-token prediction (DeepSeek-V3's recipe runs it with DualPipeV): the MTP layer and
    its copy of the embedding sit with the loss on rank 0's second chunk, and the copy shares
    chunk 0's gradient; 3 steps, deferred weight gradients, against one process from the same
    weights (untied, as DeepSeek-V3)."""
    spec = dict(mtp_num_layers=1)
    init = str(tmp_path / "init")
    (ref,) = run_distributed(trainer_ranks.train_steps, 1, layout={}, save_init=init,
                             spec=spec, timeout=300)  # fmt: skip
    got = run_distributed(trainer_ranks.train_steps, 2, load=init, spec=spec, timeout=300,
                          layout=dict(pp=2, dualpipev=True, dualpipev_dw_detach=True))  # fmt: skip
    for rank_result in got:
        _assert_steps(ref, rank_result)


def test_uneven_v_lightens_rank_0(tmp_path):
    """--decoder-first/last-pipeline-num-layers under the V: stages of 1, 2, 2 and 1 layers
    (rank 0, which also holds the output layer, gets 2 of 6), with the split, against one
    process from the same weights."""
    spec = dict(TIED, num_layers=6)
    init = str(tmp_path / "init")
    (ref,) = run_distributed(trainer_ranks.train_steps, 1, layout={}, save_init=init,
                             spec=spec, timeout=300)  # fmt: skip
    layout = dict(pp=2, dualpipev=True, dualpipev_dw_detach=True, first_stage_layers=1,
                  last_stage_layers=1)  # fmt: skip
    got = run_distributed(trainer_ranks.train_steps, 2, load=init, spec=spec, timeout=300,
                          layout=layout)  # fmt: skip
    for rank_result in got:
        _assert_steps(ref, rank_result)


SLOW_LAYOUTS = {  # layout, TrainConfig changes (DP2 needs 4 micro-batches per replica)
    "pp2-dp2-distopt": (dict(pp=2, dualpipev=True, distributed_optimizer=True),
                        dict(micro_batch_size=1)),
    "tp2-sp-pp2": (dict(tp=2, sequence_parallel=True, pp=2, dualpipev=True), {}),
    # deferred weight gradients gather their SP inputs again over TP in the W steps
    "tp2-sp-pp2-dw-detach": (dict(tp=2, sequence_parallel=True, pp=2, dualpipev=True,
                                  dualpipev_dw_detach=True), {}),
    "pp2-cp2-ring": (dict(pp=2, dualpipev=True, cp=2, cp_algo="p2p"), {}),
}  # fmt: skip


@pytest.mark.slow  # 4 processes each
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_four_process_layouts_match_one_process(reference, name):
    root, init, tokens, ref = reference
    layout, cfg = SLOW_LAYOUTS[name]
    cp = "cp2" in name  # the CP feature on; the logits pass does not split the sequence
    got = run_distributed(
        trainer_ranks.train_eval_save_logits,
        4,
        argv=["--context-parallel-size", "2"] if cp else [],
        layout=layout,
        load=init,
        save=str(root / name),
        tokens=None if cp else tokens,
        spec=TIED,
        timeout=600,
        **cfg,
    )
    for rank_result in got:
        _assert_parity(ref, rank_result)
    if not cp:  # on pipeline rank 0 (global rank 0) only
        outputs = [r["logits"] is not None for r in got]
        assert outputs[0] and outputs.count(True) == 4 // 2  # TP/DP copies of stage 0
        # TP splits the matmuls: three steps of it leave up to ~1e-5 in the logits.
        torch.testing.assert_close(got[0]["logits"], ref["logits"], rtol=0, atol=3e-5)


@pytest.mark.slow  # 3 and 4 processes
@pytest.mark.parametrize("pp", [3, 4])
def test_middle_ranks_and_odd_microbatch_counts(tmp_path, pp):
    """Ranks with a neighbour on each side (all four links both ways) and 2PP + 1
    micro-batches: PP 3 (6 layers) and PP 4 (8 layers), with and without the split."""
    spec = dict(TIED, num_layers=2 * pp)
    cfg = dict(global_batch_size=2 * pp + 1, micro_batch_size=1)
    init = str(tmp_path / "init")
    run_distributed(trainer_ranks.train_steps, 1, layout={}, steps=0, save_init=init, spec=spec)
    (ref,) = run_distributed(trainer_ranks.layouts_steps, 1, layouts=[{}], load=init,
                             spec=spec, **cfg)[0]  # fmt: skip
    layouts = [dict(pp=pp, dualpipev=True, dualpipev_dw_detach=split) for split in (0, 1)]
    got = run_distributed(trainer_ranks.layouts_steps, pp, layouts=layouts, load=init,
                          spec=spec, timeout=600, **cfg)  # fmt: skip
    for rank_result in got:
        for steps in rank_result:
            _assert_steps(ref, steps)
