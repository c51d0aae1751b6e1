"""Tiny MoE GPT at expert-parallel layouts vs. a single-process run of the same weights.

The reference saves its initial weights with Megatron's dist_checkpointing; every layout loads
them and trains 3 steps with the aux loss and z-loss on and no token dropping. Losses and grad
norms must match within 1e-5 relative (fp32), and every expert must get exactly the tokens it got
in the single-process run (routing is layout-independent).
"""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import trainer_ranks

RTOL = 1e-5
SPEC = dict(num_layers=2, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
            moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)  # fmt: skip

# (world, layout, model changes). Each runs with both token dispatchers.
LAYOUTS = {
    "ep2": (2, dict(ep=2), {}),
    "ep2-tp2-sp-etp1": (2, dict(ep=2, tp=2, sequence_parallel=True, etp=1), {}),
    "ep2-cp2": (2, dict(ep=2, cp=2), {}),
    "ep2-grouped": (2, dict(ep=2), dict(moe_grouped_gemm=True)),
    "ep2-tp2-sp-etp2": (4, dict(ep=2, tp=2, sequence_parallel=True, etp=2), {}),
    "ep2-pp2": (4, dict(ep=2, pp=2), {}),
    "ep2-dp4-distopt": (4, dict(ep=2, distributed_optimizer=True), {}),
}
DISPATCHERS = ("allgather", "alltoall")
ALL = [(n, d) for n in LAYOUTS for d in DISPATCHERS]
# Two-process rows run in CI; the rest (four processes are slow on a 2-core runner) with -m slow.
CI_ROWS = [("ep2", "allgather"), ("ep2-tp2-sp-etp1", "alltoall"), ("ep2-grouped", "alltoall")]
SLOW_ROWS = [key for key in ALL if key not in CI_ROWS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe-init") / "ckpt")
    (steps,) = run_distributed(
        trainer_ranks.train_steps, 1, layout={}, save_init=ckpt, spec=SPEC, timeout=240
    )
    return ckpt, steps


def _run(ckpt: str, keys: list[tuple[str, str]]) -> dict:
    """Each (layout, dispatcher) row's 3 steps, one process group per world size."""
    out = {}
    for world in sorted({LAYOUTS[n][0] for n, _ in keys}):
        group = [(n, d) for n, d in keys if LAYOUTS[n][0] == world]
        cases = []
        for name, dispatcher in group:
            _, layout, changes = LAYOUTS[name]
            spec = dict(SPEC, moe_token_dispatcher_type=dispatcher, **changes)
            argv = ["--context-parallel-size", str(layout["cp"])] if layout.get("cp") else []
            cases.append(dict(layout=layout, spec=spec, load=ckpt, argv=argv))
        per_rank = run_distributed(trainer_ranks.train_steps_cases, world, cases=cases,
                                   timeout=600)  # fmt: skip
        for i, key in enumerate(group):
            out[key] = [rank_results[i] for rank_results in per_rank]
    return out


@pytest.fixture(scope="module")
def ci_runs(reference):
    return _run(reference[0], CI_ROWS)


@pytest.fixture(scope="module")
def slow_runs(reference):
    return _run(reference[0], SLOW_ROWS)


def _assert_parity(ref: list[dict], runs: list[list[dict]]) -> None:
    for got in runs:  # every rank reports the job-wide figures
        assert len(got) == len(ref) == 3
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            assert g["ok"], f"step {i}: optimizer step skipped"
            for key in ("loss", "grad_norm"):
                assert math.isfinite(g[key])
                assert g[key] == pytest.approx(r[key], rel=RTOL), f"step {i} {key}"
            assert g["moe"]["tokens_per_expert"] == r["moe"]["tokens_per_expert"], f"step {i}"
            for key in ("load_balancing_loss", "z_loss"):
                assert g["moe"][key] == pytest.approx(r["moe"][key], rel=1e-4), f"step {i} {key}"


@pytest.mark.parametrize("name,dispatcher", CI_ROWS)
def test_moe_layout_matches_single_process(reference, ci_runs, name, dispatcher):
    _assert_parity(reference[1], ci_runs[(name, dispatcher)])


@pytest.mark.slow
@pytest.mark.parametrize("name,dispatcher", SLOW_ROWS)
def test_moe_layout_matches_single_process_more(reference, slow_runs, name, dispatcher):
    _assert_parity(reference[1], slow_runs[(name, dispatcher)])


def test_reference_routes_every_token(reference):
    _, ref = reference
    tokens = ref[0]["moe"]["tokens_per_expert"]
    assert sorted(tokens) == [1, 2]  # both layers are MoE layers
    # top-2 of 4 experts: every token is counted twice per layer (global batch 8 x 32 tokens).
    assert all(sum(v) == 2 * 8 * 32 for v in tokens.values()), tokens
    assert ref[0]["moe"]["load_balancing_loss"] > 0 and ref[0]["moe"]["z_loss"] > 0
    assert len({round(r["loss"], 9) for r in ref}) > 1


@pytest.mark.slow  # four more process groups; the suite's time budget
def test_moe_checkpoint_loads_across_expert_layouts(reference, tmp_path):
    """Saved at EP2 with sequential experts (dist_checkpointing): one process with sequential
    or grouped experts, and EP2 x TP2+SP with expert-TP 1, give the same logits."""
    ckpt, _ = reference
    saved = str(tmp_path / "ep2")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    ep2 = run_distributed(trainer_ranks.train_save_logits, 2, layout=dict(ep=2), load=ckpt,
                          save=saved, tokens=tokens, spec=SPEC, timeout=300)  # fmt: skip
    single = [dict(layout={}, spec=SPEC), dict(layout={}, spec=dict(SPEC, moe_grouped_gemm=True))]
    seq, grouped = run_distributed(trainer_ranks.load_logits_cases, 1, cases=single, load=saved,
                                   tokens=tokens, timeout=300)[0]  # fmt: skip
    tp = dict(layout=dict(ep=2, tp=2, sequence_parallel=True, etp=1), spec=SPEC)
    (tp_ep,) = run_distributed(trainer_ranks.load_logits_cases, 2, cases=[tp], load=saved,
                               tokens=tokens, timeout=300)[0]  # fmt: skip
    close = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(ep2[0], seq, **close)
    torch.testing.assert_close(grouped, seq, **close)
    torch.testing.assert_close(tp_ep, seq, **close)
    init = run_distributed(trainer_ranks.load_logits, 1, layout={}, load=ckpt, tokens=tokens,
                           spec=SPEC)[0]  # fmt: skip
    assert (init - seq).abs().max() > 1e-4  # the checkpoint holds the trained weights
