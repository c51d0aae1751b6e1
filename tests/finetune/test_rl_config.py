"""``--rl-config`` files: what is not a mapping, and a list where one value belongs, are one line
naming the file and the key; keys anyspeed does not read are named in one warning (issue 43,
item 3). The keys it reads become flags (tests/finetune/test_grpo_resume.py)."""

from __future__ import annotations

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.table import STAGES


def _expand(tmp_path, text: str) -> list[str]:
    f = tmp_path / "rl.yaml"
    f.write_text(text)
    return STAGES["grpo"]().argv(["--stage", "grpo", "--rl-config", str(f)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- 1\n- 2\n", "the file must be a YAML mapping (key: value lines), not a list"),
        ("rl_config: 3\n", "rl_config must be a mapping, not 3"),
        ("generate_config:\n  sampling_config: [1]\n", "sampling_config must be a mapping"),
        ("rl_config:\n  clip_ratio: [0.2, 3]\n", "rl_config.clip_ratio takes one value"),
    ],
)
def test_bad_structure_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    with pytest.raises(UsageError) as info:
        _expand(tmp_path, text)
    line = str(info.value)
    assert "\n" not in line and "rl.yaml" in line and message in line, line


def test_unread_keys_are_named_and_read_ones_become_flags(tmp_path, capsys):
    argv = _expand(
        tmp_path,
        "use_integrated_worker: true\nrl_config:\n  clip_ratio: 0.1\n  blocking: true\n"
        "  verifier_function: [a:b, c:d]\nmegatron_training:\n  lr: 1e-6\n",
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not read: use_integrated_worker, rl_config.blocking" in err
    assert argv[argv.index("--clip-ratio") + 1] == "0.1"
    i = argv.index("--verifier-function")
    assert argv[i + 1 : i + 3] == ["a:b", "c:d"]


# configs/grpo_qwen25_7b_A3.yaml's shape and keys, sizes scaled to the tiny Qwen2 fixture
MS_RL = """
defaults:
  - model:
      - tiny_qwen2
megatron_training:
  model: tiny_qwen2
  use_mcore_models: true
  use_flash_attn: true
  no_masked_softmax_fusion: true
  attention_softmax_in_fp32: true
  no_gradient_accumulation_fusion: true
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: {tok}
  global_batch_size: 4
  seq_length: 96
  save_interval: 100
  train_iters: 2
  stage: ray_grpo
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  distributed_backend: nccl
  no_shared_storage: true
  dataset_additional_keys: ['labels',]
  data_path: {data}
  split: 100,0,0
  no_shuffle: false
  full_shuffle_instruction_dataset: false
  seed: 5
  reuse_fp32_param: false
actor_config:
  model: tiny_qwen2
  micro_batch_size: 4
  tensor_model_parallel_size: 1
  lr: 1e-6
  lr_decay_style: constant
  min_lr: 0
  weight_decay: 0.01
  clip_grad: 1.0
  adam_beta2: 0.95
  finetune: true
  load: {load}
  save: {save}
  no_load_optim: true
rl_config:
  use_integrated_worker: true
  gamma: 1.0
  lam: 0.95
  mini_batch_size: 16
  max_prompt_length: 64
  clip_ratio: 0.2
  n_samples_per_prompt: 4
  verifier_function: ["helpers.user_rewards:digits"]
  verifier_weight: [1.0]
generate_config:
  infer_tensor_parallel_size: 1
  sampling_config:
    max_tokens: 16
    temperature: 1.0
"""
MODEL = """
tiny_qwen2:
  use_mcore_models: true
  num_layers: 2
  hidden_size: 64
  ffn_hidden_size: 128
  num_attention_heads: 4
  rotary_base: 10000
  max_position_embeddings: 256
  make_vocab_size_divisible_by: 1
  padded_vocab_size: 768
  untie_embeddings_and_output_weights: true
  add_qkv_bias: true
  disable_bias_linear: true
  group_query_attention: true
  num_query_groups: 2
  position_embedding_type: rope
  norm_epsilon: 1e-6
  normalization: RMSNorm
  swiglu: true
"""
BY_HAND = """--stage grpo --tokenizer-type PretrainedFromHF --rollout-batch-size 4 --seq-length 96
--save-interval 100 --train-iters 2 --attention-dropout 0.0 --init-method-std 0.01
--hidden-dropout 0.0 --split 100,0,0 --seed 5 --micro-batch-size 4
--tensor-model-parallel-size 1 --lr 1e-6 --lr-decay-style constant --min-lr 0
--weight-decay 0.01 --clip-grad 1.0 --adam-beta2 0.95 --finetune --no-load-optim
--global-batch-size 16 --max-prompt-length 64 --clip-ratio 0.2 --n-samples-per-prompt 4
--verifier-function helpers.user_rewards:digits --verifier-weight 1.0
--infer-tensor-parallel-size 1 --max-response-length 16 --temperature 1.0 --num-layers 2
--hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --rotary-base 10000
--max-position-embeddings 256 --make-vocab-size-divisible-by 1 --padded-vocab-size 768
--untie-embeddings-and-output-weights --add-qkv-bias --disable-bias-linear
--group-query-attention --num-query-groups 2 --position-embedding-type rope
--norm-epsilon 1e-6 --normalization RMSNorm --swiglu --use-mcore-models --use-flash-attn
--no-masked-softmax-fusion --attention-softmax-in-fp32 --no-gradient-accumulation-fusion
--distributed-backend nccl --no-shared-storage""".split()


def test_a_mindspeed_rl_config_is_the_run_its_flags_describe(tmp_path, add_prompts, hf_tok,
                                                             tiny_qwen, capsys):  # fmt: skip
    """A MindSpeed-RL config (its model file beside it, ``megatron_training``, ``actor_config``
    over it, ``rl_config``, ``generate_config``) parses to the same run as the flags written by
    hand; its runtime keys are named in the one warning line."""
    import os

    from anyspeed.stages.prepare import prepare

    load, save = tiny_qwen, str(tmp_path / "ckpt")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_qwen2.yaml").write_text(MODEL)
    cfg = tmp_path / "grpo_tiny_qwen2.yaml"
    cfg.write_text(MS_RL.format(tok=hf_tok, data=add_prompts, load=load, save=save))
    os.environ.pop("WORLD_SIZE", None)
    run, _ = prepare(["--stage", "grpo", "--rl-config", str(cfg)], "launcher", "posttrain")
    err = capsys.readouterr().err
    assert "not read: rl_config.use_integrated_worker, rl_config.gamma, rl_config.lam (" in err
    assert "megatron_training" not in err and "defaults" not in err
    want, _ = prepare([*BY_HAND, "--tokenizer-name-or-path", hf_tok, "--data-path",
                       add_prompts, "--load", load, "--save", save], "launcher",
                      "posttrain")  # fmt: skip
    got = {k: v for k, v in vars(run.args).items() if k != "rl_config"}
    assert got == {k: v for k, v in vars(want.args).items() if k != "rl_config"}
    assert run.model == want.model and run.layout == want.layout


def test_a_ppo_configs_critic_section(tmp_path, capsys):
    """``critic_config`` (configs/ppo_qwen25_32b_A3.yaml): its load and lr are the critic's
    flags; a layout key that differs from the policy's is named (the critic trains at the
    policy's layout), one that agrees is not."""
    f = tmp_path / "ppo.yaml"
    f.write_text("actor_config:\n  lr: 1e-6\n  tensor_model_parallel_size: 2\n"
                 "critic_config:\n  load: ./critic\n  lr: 5e-6\n  tensor_model_parallel_size: 2\n"
                 "  micro_batch_size: 8\n")  # fmt: skip
    argv = STAGES["ppo"]().argv(["--stage", "ppo", "--rl-config", str(f)])
    assert argv[argv.index("--critic-load") + 1] == "./critic"
    assert argv[argv.index("--critic-lr") + 1] == "5e-6" and argv[argv.index("--lr") + 1] == "1e-6"
    err = capsys.readouterr().err
    assert "not read: critic_config.micro_batch_size (" in err


DAPO = """rl_config:
  kl_ctrl_type: fixed
  clip_ratio: 0.2
  token_level_loss: false
  clip_higher_enable: true
  clip_ratio_low: 0.2
  clip_ratio_high: 0.28
  overlong_buffer_enable: true
  rollout_max_tokens : 2048
  overlong_buffer: 512
  overlong_buffer_penalty_factor: 0.1
  filter_groups_enable: true
  filter_groups_metric: acc_for_dapo
  filter_groups_max_batches: -1
  filter_groups_train_batch_size: 32
"""


def test_a_dapo_configs_switches_become_dapos_flags(tmp_path, capsys):
    """configs/dapo_qwen3_32b_A3.yaml's DAPO block: each ``*_enable`` switch with its values
    is anyspeed's DAPO flag (token_level_loss false: a mean per sequence, then over them); an
    unbounded ``filter_groups_max_batches`` (-1) is named: --max-num-gen-batches bounds it."""
    argv = _expand(tmp_path, DAPO)

    def value(flag: str) -> str:
        return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one wins

    assert value("--loss-agg-mode") == "seq-mean-token-mean"
    assert (value("--clip-ratio"), value("--clip-ratio-high")) == ("0.2", "0.28")
    assert (value("--overlong-buffer-len"), value("--overlong-penalty-factor")) == ("512", "0.1")
    assert value("--max-response-length") == "2048" and "--filter-groups" in argv
    err = capsys.readouterr().err
    assert "not read: rl_config.filter_groups_max_batches (" in err and "clip" not in err
