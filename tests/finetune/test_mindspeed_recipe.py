"""A MindSpeed-LLM recipe runs as written: the flags of ``examples/mcore/qwen3_moe/
tune_qwen3_30b_a3b_4K_lora_ptd.sh`` (LoRA on attention and every expert, grouped GEMM,
``alltoall_seq``, ``--first-k-dense-replace -1 --moe-layer-freq -1``, ``--spec``,
``--enable-hf2mg-convert``, ``--ckpt-format torch``, ``--lora-fusion``...), sizes scaled to a
tiny Qwen3-MoE, through the ``anyspeed posttrain`` command at EP2, from the raw alpaca data."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.instruction import VOCAB, alpaca_records

RECIPE = """
--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-grouped-gemm
--moe-permutation-async-comm --moe-token-dispatcher-type alltoall_seq
--moe-router-load-balancing-type aux_loss --moe-layer-freq -1 --first-k-dense-replace -1
--moe-aux-loss-coeff 0.001 --use-flash-attn --use-fused-rotary-pos-emb
--use-rotary-position-embeddings --use-fused-swiglu --use-fused-rmsnorm
--no-masked-softmax-fusion --use-distributed-optimizer --micro-batch-size 2
--global-batch-size 8 --lr 1.25e-5 --lr-decay-style cosine --min-lr 1.25e-7 --weight-decay 1e-1
--lr-warmup-fraction 0.01 --attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0
--clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096 --seed 42
--train-iters 2 --seq-length 96 --no-shared-storage --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --use-mcore-models
--spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec --kv-channels 16 --qk-layernorm
--norm-topk-prob --max-position-embeddings 256 --num-layers 2 --hidden-size 64
--ffn-hidden-size 128 --num-attention-heads 4 --tokenizer-type PretrainedFromHF
--make-vocab-size-divisible-by 1 --rotary-base 10000 --untie-embeddings-and-output-weights
--disable-bias-linear --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-6
--swiglu --attention-softmax-in-fp32 --no-gradient-accumulation-fusion --group-query-attention
--num-query-groups 2 --ckpt-format torch --handler-name AlpacaStyleInstructionHandler
--split 100,0,0 --enable-hf2mg-convert --model-type-hf qwen3-moe --log-interval 1
--save-interval 2 --eval-interval 2 --eval-iters 0 --no-load-optim --no-load-rng --finetune
--stage sft --is-instruction-dataset --tokenizer-not-use-fast --prompt-type qwen3
--no-pad-to-seq-lengths --lora-r 16 --lora-alpha 32 --lora-fusion
--lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2
""".split()


def test_qwen3_moe_lora_recipe_runs_as_written(tiny_moe, hf_tok, tmp_path):
    """As MindSpeed-LLM's recipes now do, --data-path names the raw alpaca .json: it is
    preprocessed at start-up with the recipe's handler and template."""
    save, data = tmp_path / "ck", tmp_path / "alpaca.json"
    data.write_text(json.dumps(alpaca_records(16)))
    argv = [*RECIPE, "--padded-vocab-size", str(VOCAB), "--tokenizer-name-or-path", hf_tok,
            "--data-path", str(data), "--load", tiny_moe, "--save", str(save)]  # fmt: skip
    cmd = [sys.executable, "-m", "anyspeed", "posttrain", "--nproc-per-node", "2", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(x.startswith("anyspeed") for x in out.stderr.splitlines()), out.stderr
    assert "--ckpt-format torch: checkpoints are saved as torch_dist" in out.stderr
    assert f"preprocessing -> {tmp_path / 'alpaca'}" in out.stderr
    assert (tmp_path / "alpaca_packed_labels_document.idx").is_file()
    assert "EP=2" in out.stdout and "4 experts top-2" in out.stdout
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(save / "iter_0000002"))
    for layer in (0, 1):  # --first-k-dense-replace -1 --moe-layer-freq -1: every layer MoE
        assert f"decoder.layers.{layer}.mlp.experts.experts.linear_fc2.lora_B" in keys
    assert "decoder.layers.0.self_attention.linear_qkv.lora_A" in keys
