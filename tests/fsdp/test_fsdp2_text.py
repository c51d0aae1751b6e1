"""``anyspeed fsdp2`` on text models against a single-process transformers training loop (same
data order, AdamW, fp32): loss and grad norm per step, every parameter after 3 steps (read
back from the exported directory by transformers), at DP2 and DP2 x Ulysses 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import fsdp_ranks as R

SEQ, STEPS, LR, WD, CLIP = 32, 3, 1e-3, 0.1, 1.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    from helpers.corpora import write_corpus

    return write_corpus(str(tmp_path_factory.mktemp("fsdp_corpus") / "corpus"), docs=60)


def _compare(tmp_path, corpus: str, kind: str, world: int, gbs: int, **parallel) -> dict:
    """Train ``kind`` at ``world`` ranks and in one process; assert parity; the rank results."""
    model_dir = R.text_model(tmp_path / kind, kind)
    out = tmp_path / "out"
    cfg = R.write_config(
        tmp_path / "c.yaml",
        model_dir,
        corpus,
        parallel=parallel,
        training={"output_dir": str(out), "save_hf_weights": True, "max_grad_norm": CLIP},
    )
    ranks = run_distributed(R.train_rank, world, config=cfg, timeout=240)
    ref = R.reference_loop(model_dir, R.text_batches(corpus, SEQ, gbs, STEPS), LR, WD, CLIP)
    np.testing.assert_allclose(ranks[0]["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ranks[0]["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=1e-6)
    trained = R.load_params(str(out / "hf"))
    assert set(trained) == set(ref["params"])
    worst = max((trained[k] - ref["params"][k]).abs().max().item() for k in trained)
    assert worst < 1e-5, f"{kind}: a parameter differs by {worst:.2e} after {STEPS} steps"
    moved = max((trained[k] - R.load_params(model_dir)[k]).abs().max().item() for k in trained)
    assert moved > 1e-3  # training changed the weights: the comparison is not of two copies
    return ranks


@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_dp2_equals_one_process(tmp_path, corpus: str, kind: str) -> None:
    _compare(tmp_path, corpus, kind, world=2, gbs=4)


def test_dp2_ulysses2_equals_one_process(tmp_path, corpus: str) -> None:
    _compare(tmp_path, corpus, "qwen2", world=4, gbs=4, cp_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "phi3"])
def test_dp2_other_families(tmp_path, corpus: str, kind: str) -> None:
    _compare(tmp_path, corpus, kind, world=2, gbs=4)


def test_shards_are_one_over_n(tmp_path, corpus: str) -> None:
    """Each rank holds half of the fp32 parameters; the estimate printed before start says so."""
    from anyspeed.fsdp.config import load
    from anyspeed.fsdp.estimate import estimate
    from anyspeed.fsdp.model import load_model

    model_dir = R.text_model(tmp_path / "m", "qwen2")
    cfg_path = R.write_config(tmp_path / "c.yaml", model_dir, corpus, training={"max_steps": 1})
    ranks = run_distributed(R.train_rank, 2, config=cfg_path, timeout=240)
    whole = sum(p.numel() * 4 for p in R.load_params(model_dir).values())
    for r in ranks:
        assert r["local_bytes"] == pytest.approx(whole / 2, rel=1e-6)
    cfg = load(cfg_path)
    est = estimate(load_model(cfg, meta=True), cfg, 2)
    assert est.params_bytes == pytest.approx(whole / 2, rel=1e-6)
    assert est.optimizer_bytes == 2 * est.params_bytes  # AdamW's two moments, all trainable
    assert torch.tensor(est.gathered_bytes) > 0


def _instruction_batches(prefix: str, seq: int, gbs: int, steps: int) -> list[dict]:
    """Global batches read with Megatron's own reader: inputs ``ids[:-1]``, targets the stored
    labels shifted by one (prompt tokens -100), right-padded and masked."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ids = IndexedDataset(f"{prefix}_packed_input_ids_document")
    labels = IndexedDataset(f"{prefix}_packed_labels_document")
    out = []
    for k in range(steps):
        rows = range(k * gbs, (k + 1) * gbs)
        pairs = [(np.asarray(ids[i])[: seq + 1], np.asarray(labels[i])[: seq + 1]) for i in rows]
        n = max(len(a) - 1 for a, _ in pairs)
        batch = {
            "input_ids": torch.zeros(gbs, n, dtype=torch.long),
            "labels": torch.full((gbs, n), -100, dtype=torch.long),
            "attention_mask": torch.zeros(gbs, n, dtype=torch.long),
        }
        for r, (a, lab) in enumerate(pairs):
            batch["input_ids"][r, : len(a) - 1] = torch.from_numpy(a[:-1].astype(np.int64))
            batch["labels"][r, : len(a) - 1] = torch.from_numpy(lab[1:].astype(np.int64))
            batch["attention_mask"][r, : len(a) - 1] = 1
        out.append(batch)
    return out


def test_instruction_data_dp2_equals_one_process(tmp_path, hf_tok: str) -> None:
    """The answers-only loss of an instruction dataset (``anyspeed preprocess`` output)."""
    import json

    from helpers.instruction import alpaca_records, preprocess

    src = tmp_path / "alpaca.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in alpaca_records(16)))
    prefix = preprocess(str(src), str(tmp_path / "sft"), hf_tok)
    model_dir = R.text_model(tmp_path / "m", "qwen2", vocab=640)
    cfg = R.write_config(
        tmp_path / "c.yaml", model_dir, prefix, data={"cutoff_len": 64},
        training={"output_dir": str(tmp_path / "out"), "save_hf_weights": True,
                  "max_grad_norm": CLIP},
    )  # fmt: skip
    ranks = run_distributed(R.train_rank, 2, config=cfg, timeout=240)
    ref = R.reference_loop(model_dir, _instruction_batches(prefix, 64, 4, STEPS), LR, WD, CLIP)
    np.testing.assert_allclose(ranks[0]["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ranks[0]["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=1e-6)
    trained = R.load_params(str(tmp_path / "out" / "hf"))
    worst = max((trained[k] - ref["params"][k]).abs().max().item() for k in trained)
    assert worst < 1e-5


def test_recompute_and_bf16_compute(tmp_path, corpus: str) -> None:
    """Per-block activation checkpointing changes nothing (within 1e-5 of the one-process
    loop); bf16 parameters with fp32 reductions (FSDP2's MixedPrecisionPolicy) stay within
    bf16's rounding of it."""
    model_dir = R.text_model(tmp_path / "m", "qwen2")
    ref = R.reference_loop(model_dir, R.text_batches(corpus, SEQ, 4, STEPS), LR, WD, CLIP)
    runs = {}
    for name, parallel in (("recompute", {"recompute": True}), ("bf16", {"param_dtype": "bf16"})):
        cfg = R.write_config(tmp_path / f"{name}.yaml", model_dir, corpus, parallel=parallel,
                             training={"max_grad_norm": CLIP})  # fmt: skip
        runs[name] = run_distributed(R.train_rank, 2, config=cfg, timeout=240)[0]
    np.testing.assert_allclose(runs["recompute"]["loss"], ref["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(runs["bf16"]["loss"], ref["loss"], rtol=0, atol=2e-2)
    assert runs["bf16"]["loss"] != runs["recompute"]["loss"]  # bf16 did compute in bf16
