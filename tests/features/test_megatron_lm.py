"""Megatron-LM's own pretrain_gpt.py with the one added line, on CPU processes.

Needs a Megatron-LM checkout at tag core_v0.16.1: set ANYSPEED_MEGATRON_LM to its path (see
README). Skipped when absent. The test copies pretrain_gpt.py to a temporary folder and inserts
``import anyspeed.megatron_adaptor`` after ``import torch`` -- the one line a user adds -- and
runs the usual torchrun command, ``--distributed-backend nccl`` included.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.megatron_lm import MARKS, MLM

pytestmark = MARKS

COMMON = [
    "--distributed-backend",
    "nccl",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-decay-iters",
    "30",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "255",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--split",
    "100,0,0",
    "--seed",
    "1234",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def add_one_line(dst: Path) -> Path:
    src = Path(MLM, "pretrain_gpt.py").read_text().splitlines()
    i = next(i for i, line in enumerate(src) if line.strip() == "import torch")
    src.insert(i + 1, "import anyspeed.megatron_adaptor")
    path = dst / "pretrain_gpt.py"
    path.write_text("\n".join(src) + "\n")
    return path


def torchrun(
    script: Path, *args: str, timeout: int = 400, nproc: int = 2, **env_vars: str
) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")]),
               **env_vars)  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *COMMON,
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(out)}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return add_one_line(tmp_path_factory.mktemp("mlm"))


@pytest.mark.parametrize(
    "layout",
    [
        # anyspeed's own flags go through Megatron-LM's parser too.
        ["--tensor-model-parallel-size", "2", "--optimization-level", "1", "--use-fused-swiglu"],
        ["--pipeline-model-parallel-size", "2"],
    ],
)
def test_pretrain_gpt_trains_20_iterations(script, layout):
    losses = torchrun(script, *layout, "--train-iters", "20")
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[20] < losses[1] - 0.3, losses


def test_pretrain_gpt_save_and_resume_continues_exactly(script, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    layout = ["--pipeline-model-parallel-size", "2"]
    # Same schedule length (30) in every run; the first stops after 20 as a job would.
    first = torchrun(
        script,
        *layout,
        "--train-iters",
        "30",
        "--exit-interval",
        "20",
        "--save",
        ckpt,
        "--save-interval",
        "10",
    )
    assert Path(ckpt, "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    resumed = torchrun(
        script,
        *layout,
        "--train-iters",
        "30",
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--save-interval",
        "10",
    )
    straight = torchrun(script, *layout, "--train-iters", "30")
    assert min(resumed) == 21, "resume must continue after iteration 20"
    # Megatron-LM does not reset its loss accumulator after the first logged iteration of a
    # run (training_log: should_reset = not is_first_iteration), so the resumed run's line for
    # iteration 22 is the mean of iterations 21 and 22. Every other line is one iteration.
    expected = dict(straight)
    expected[22] = (straight[21] + straight[22]) / 2
    for it in range(21, 31):
        assert resumed[it] == pytest.approx(expected[it], rel=1e-5), (
            it,
            [resumed[i] for i in range(21, 31)],
            [straight[i] for i in range(21, 31)],
        )
    assert max(first) == 20
    for it in range(1, 21):
        assert first[it] == pytest.approx(straight[it], rel=1e-5)


@pytest.mark.parametrize("algo", ["megatron_cp_algo", "ulysses_cp_algo"])
def test_pretrain_gpt_context_parallel_matches_data_parallel(script, algo):
    """anyspeed's CP inside Megatron-LM: CP=2 losses equal the DP=2 run's (no dropout)."""
    model = ["--train-iters", "5", "--position-embedding-type", "rope", "--swiglu",
             "--normalization", "RMSNorm", "--no-create-attention-mask-in-dataloader",
             "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    dp = torchrun(script, *model)
    cp = torchrun(script, *model, "--context-parallel-size", "2", "--context-parallel-algo", algo)
    assert sorted(cp) == list(range(1, 6))
    for it in range(1, 6):
        assert cp[it] == pytest.approx(dp[it], rel=1e-5), (it, cp, dp)


def test_pretrain_gpt_hybrid_context_parallel_matches_data_parallel(script):
    """hybrid_cp_algo (Ulysses 2 inside, ring 2 across) at CP=4 equals DP=4 in Megatron-LM."""
    model = ["--train-iters", "3", "--position-embedding-type", "rope", "--swiglu",
             "--normalization", "RMSNorm", "--no-create-attention-mask-in-dataloader",
             "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    dp = torchrun(script, *model, nproc=4)
    cp = torchrun(script, *model, "--context-parallel-size", "4", "--context-parallel-algo",
                  "hybrid_cp_algo", "--ulysses-degree-in-cp", "2", nproc=4)  # fmt: skip
    assert sorted(cp) == list(range(1, 4))
    for it in range(1, 4):
        assert cp[it] == pytest.approx(dp[it], rel=1e-5), (it, cp, dp)


def test_pretrain_gpt_trains_moe_with_expert_parallelism_and_grouped_gemm(script):
    """MoE in Megatron-LM's own path: EP2, alltoall dispatcher, grouped GEMM (which Megatron-LM
    otherwise gates on a GPU of compute capability >= 8), fp32."""
    losses = torchrun(script, "--train-iters", "20", "--num-experts", "4",
                      "--expert-model-parallel-size", "2", "--moe-grouped-gemm",
                      "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01",
                      "--disable-bias-linear")  # fmt: skip
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[20] < losses[1] - 0.3, losses


LLAMA_TP2 = ["--tensor-model-parallel-size", "2", "--position-embedding-type", "rope", "--swiglu",
             "--normalization", "RMSNorm", "--disable-bias-linear", "--group-query-attention",
             "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
             "--no-create-attention-mask-in-dataloader", "--hidden-dropout", "0",
             "--attention-dropout", "0"]  # fmt: skip

# Megatron-LM's own model and load_checkpoint (with the one line) on fixed tokens: the logits
# the converted model must give. The TP ranks' vocabulary halves are gathered.
MEGATRON_LM_LOGITS = """
import os
from functools import partial

import torch
import anyspeed.megatron_adaptor

from gpt_builders import gpt_builder
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.training.checkpointing import load_checkpoint
from megatron.training.initialize import initialize_megatron
from megatron.training.training import get_model
from model_provider import model_provider

initialize_megatron()
model = get_model(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder,
                  wrap_with_ddp=False)
load_checkpoint(model, None, None)
model[0].eval()
tokens = torch.load(os.environ["TOKENS"])
with torch.no_grad():
    logits = model[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
if torch.distributed.get_rank() == 0:
    torch.save(logits.float(), os.environ["LOGITS"])
"""


def anyspeed_convert(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "anyspeed", "convert", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _model_tensors(ckpt: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint: per rank file (legacy) or whole (torch_dist)."""
    from anyspeed.checkpoint.reads import checkpoint_dir
    from anyspeed.convert.dcp_io import DcpReader
    from anyspeed.convert.engine import materialize
    from anyspeed.safe_pickle import load_torch

    it = checkpoint_dir(ckpt)
    if fmt == "torch":
        return {f"{rank.name}/{k}": v for rank in sorted(it.glob("mp_rank_*"))
                for k, v in load_torch(rank / "model_optim_rng.pt")["model"].items()
                if isinstance(v, torch.Tensor)}  # fmt: skip
    reader = DcpReader(it)
    keys = [k for k, md in reader.tensors.items()
            if hasattr(md, "chunks") and not k.startswith("optimizer")]  # fmt: skip
    return {k: materialize(reader.read(k, (0,) * len(reader.shape(k)), reader.shape(k)))
            for k in keys}  # fmt: skip


def _megatron_lm_checkpoint(script, tmp_path: Path, fmt: str):
    """pretrain_gpt.py's (the one line) LLaMA-style TP2 checkpoint, fixed tokens, and the
    logits Megatron-LM's own model gives on them after its own load."""
    ckpt = tmp_path / "ckpt"
    torchrun(script, *LLAMA_TP2, "--train-iters", "2", "--save", str(ckpt), "--save-interval",
             "2", "--ckpt-format", fmt)  # fmt: skip
    tokens = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    (tmp_path / "logits.py").write_text(MEGATRON_LM_LOGITS)
    torchrun(tmp_path / "logits.py", *LLAMA_TP2, "--load", str(ckpt), "--ckpt-format", fmt,
             "--exit-on-missing-checkpoint", TOKENS=str(tmp_path / "tokens.pt"),
             LOGITS=str(tmp_path / "logits.pt"))  # fmt: skip
    return ckpt, tokens, torch.load(tmp_path / "logits.pt")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_pretrain_gpt_checkpoint_converts_to_hf_and_back(script, tmp_path, fmt):
    """pretrain_gpt.py (the one line) saves a LLaMA-style TP2 model; anyspeed converts it to HF
    from the stored args alone (tokenizer files from the user); transformers' logits equal
    Megatron-LM's own on its own load; converting back gives Megatron-LM's tensors."""
    from anyspeed.convert.verify import hf_logits

    hf, back = tmp_path / "hf", tmp_path / "back"
    ckpt, tokens, megatron = _megatron_lm_checkpoint(script, tmp_path, fmt)
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"stand-in": "tokenizer"}\n')
    anyspeed_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                     str(ckpt), "--save-dir", str(hf), "--hf-cfg-dir", str(tok),
                     "--model-type-hf", "llama2")  # fmt: skip
    assert (hf / "tokenizer.json").is_file()
    got = hf_logits(hf, tokens)
    assert megatron.shape == got.shape == (2, 16, 256) and megatron.std() > 0.1
    assert (got - megatron).abs().max() <= 1e-4
    anyspeed_convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                     "--save-dir", str(back), "--target-tensor-parallel-size", "2",
                     "--ckpt-format", "legacy" if fmt == "torch" else fmt)  # fmt: skip
    want, have = _model_tensors(ckpt, fmt), _model_tensors(back, fmt)
    assert sorted(want) == sorted(have)
    for name, t in want.items():
        assert torch.equal(have[name], t), name


def test_pretrain_gpt_checkpoint_converts_with_a_config_json_transformers_wrote(script, tmp_path):
    """--hf-cfg-dir holding the config.json transformers saves for the same model (issue 43,
    item 9): Megatron-LM stores --rope-type unset (None), which compares as its default; the
    conversion keeps that config.json and transformers' logits equal Megatron-LM's own."""
    from transformers import LlamaConfig

    from anyspeed.convert.verify import hf_logits

    ckpt, tokens, megatron = _megatron_lm_checkpoint(script, tmp_path, "torch_dist")
    cfg, hf = tmp_path / "cfg", tmp_path / "hf"
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-5, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(cfg)  # fmt: skip
    (cfg / "tokenizer.json").write_text('{"stand-in": "tokenizer"}\n')
    assert "rope_parameters" in json.loads((cfg / "config.json").read_text())  # transformers 5
    anyspeed_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                     str(ckpt), "--save-dir", str(hf), "--hf-cfg-dir", str(cfg),
                     "--model-type-hf", "llama2")  # fmt: skip
    written, given = (json.loads((d / "config.json").read_text()) for d in (hf, cfg))
    for c in (written, given):  # but the weights' dtype, filled in
        c.pop("dtype", None), c.pop("torch_dtype", None)
    assert written == given
    got = hf_logits(hf, tokens)
    assert megatron.shape == got.shape == (2, 16, 256) and megatron.std() > 0.1
    assert (got - megatron).abs().max() <= 1e-4


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_pretrain_gpt_load_never_runs_code_from_a_checkpoint(script, tmp_path, fmt):
    """A payload planted in .metadata, common.pt (torch_dist) or the rank file (torch) of a
    pretrain_gpt.py checkpoint: --load behind the one line refuses it with one line from rank 0
    and exit code 1, and the payload never runs."""
    import pickle
    import shutil

    from anyspeed.safe_pickle import load_torch

    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    args = [*LLAMA_TP2, "--train-iters", "1", "--ckpt-format", fmt]
    torchrun(script, *args, "--save", str(ckpt), "--save-interval", "1")
    it = ckpt / "iter_0000001"
    targets = [it / ".metadata", it / "common.pt"] if fmt == "torch_dist" else [
        it / "mp_rank_01" / "model_optim_rng.pt"]  # fmt: skip
    for target in targets:
        planted = tmp_path / f"planted-{target.name}"
        shutil.copytree(ckpt, planted)
        path = planted / target.relative_to(ckpt)
        if target.name == ".metadata":
            path.write_bytes(pickle.dumps(_RunsCode(marker)))
        else:
            torch.save(dict(load_torch(path), rng_state=[_RunsCode(marker)]), path)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(script), *COMMON, *args, "--load", str(planted)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyspeed: error:")]
        assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-4000:]
        assert f"{path.name}: refusing posix.system" in lines[0], lines[0]
        launcher = 'Traceback (most recent call last):\n  File "<frozen runpy>"'  # torchrun's
        assert proc.stderr.count("Traceback") == proc.stderr.count(launcher), proc.stderr[-4000:]
        assert not marker.exists()


def _from_one_save(script: Path, tmp_path: Path, layers: int, iters: int) -> tuple:
    """Dropout off, ``layers`` layers saved once at PP1 (Megatron seeds each stage's
    initialisation apart, so every run starts from it with --finetune): the fine-tuning flags
    (``--num-layers`` left to the caller) and the PP1 run's losses."""
    ckpt = str(tmp_path / "ckpt")
    model = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    torchrun(script, *model, "--num-layers", str(layers), "--train-iters", "1", "--save", ckpt,
             "--save-interval", "1", nproc=1)  # fmt: skip
    tune = [*model, "--train-iters", str(iters), "--load", ckpt, "--finetune"]
    one = torchrun(script, *tune, "--num-layers", str(layers), nproc=1)
    assert sorted(one) == list(range(1, iters + 1))
    return tune, one


def _same_losses(got: dict, want: dict, what: Any) -> None:
    assert sorted(got) == sorted(want), (what, got)
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=1e-5), (what, it, got, want)


@pytest.mark.slow
def test_pretrain_gpt_uneven_pipeline_stages_match_one_stage(script, tmp_path):
    """PP2 with uneven stages (3 layers: MindSpeed-LLM's --num-layer-list 1,2, and Megatron's
    --decoder-last-pipeline-num-layers 1) gives the PP1 run's losses within 1e-5."""
    tune, one = _from_one_save(script, tmp_path, 3, 4)
    for stages in (["--num-layer-list", "1,2"], ["--decoder-last-pipeline-num-layers", "1"]):
        two = torchrun(script, *tune, "--num-layers", "3", "--pipeline-model-parallel-size", "2",
                       *stages)  # fmt: skip
        _same_losses(two, one, stages)


@pytest.mark.slow
def test_pretrain_gpt_noop_layers_match_one_stage(script, tmp_path):
    """PP2 with MindSpeed's --noop-layers (3 real layers as 4 slots, slot 1 empty: stages of
    1 and 2 real layers, as Megatron's own --pipeline-model-parallel-layout) gives the PP1
    run's losses within 1e-5, from one PP1 save (the real layers keep their numbers)."""
    tune, one = _from_one_save(script, tmp_path, 3, 4)
    two = torchrun(script, *tune, "--num-layers", "4", "--noop-layers", "1",
                   "--pipeline-model-parallel-size", "2")  # fmt: skip
    _same_losses(two, one, "noop")


@pytest.mark.slow
def test_pretrain_gpt_num_layer_list_of_unequal_middle_stages(script, tmp_path):
    """PP4 with MindSpeed-LLM's --num-layer-list 1,2,1,1 (middle stages that Megatron-Core
    cannot size: Megatron's own --pipeline-model-parallel-layout) gives the PP1 run's losses
    within 1e-5, from one PP1 save."""
    tune, one = _from_one_save(script, tmp_path, 5, 3)
    four = torchrun(script, *tune, "--num-layers", "5", "--num-layer-list", "1,2,1,1",
                    "--pipeline-model-parallel-size", "4", nproc=4, timeout=600)  # fmt: skip
    _same_losses(four, one, "1,2,1,1")


FSDP_MODEL = ["--train-iters", "4", "--position-embedding-type", "rope", "--swiglu",
              "--normalization", "RMSNorm", "--no-create-attention-mask-in-dataloader",
              "--hidden-dropout", "0", "--attention-dropout", "0",
              "--untie-embeddings-and-output-weights"]  # fmt: skip
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
                 "fsdp_dtensor", "--data-parallel-sharding-strategy"]  # fmt: skip


@pytest.mark.parametrize(
    "fsdp",
    [
        ["--use-torch-fsdp2"],
        [*MEGATRON_FSDP, "optim_grads_params"],
        [*MEGATRON_FSDP, "optim_grads"],
        [*MEGATRON_FSDP, "optim"],
    ],
    ids=["torch-fsdp2", "megatron-fsdp-zero3", "megatron-fsdp-zero2", "megatron-fsdp-zero1"],
)
def test_pretrain_gpt_fsdp_matches_distributed_optimizer(script, fsdp):
    """Megatron's FSDP paths in pretrain_gpt.py on this device (gloo off CUDA) equal DDP with
    the distributed optimizer, step by step."""
    ref = torchrun(script, *FSDP_MODEL, "--use-distributed-optimizer")
    got = torchrun(script, *FSDP_MODEL, *fsdp)
    assert sorted(got) == list(range(1, 5))
    for it in range(1, 5):
        assert got[it] == pytest.approx(ref[it], rel=1e-5), (it, got, ref)


def _resumes_exactly(script: Path, ckpt: str, model: list[str]) -> None:
    """Saved at step 3 and resumed, the run's losses are the uninterrupted run's."""
    straight = torchrun(script, *model)
    torchrun(script, *model, "--save", ckpt, "--save-interval", "3", "--exit-interval", "3")
    resumed = torchrun(script, *model, "--load", ckpt)
    expected = dict(straight)
    expected[5] = (straight[4] + straight[5]) / 2  # Megatron-LM's first line after a resume
    assert sorted(resumed) == [4, 5, 6]
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(expected[it], rel=1e-5), (it, resumed, straight)


def test_pretrain_gpt_torch_fsdp2_resumes_exactly(script, tmp_path):
    """pretrain_gpt.py --use-torch-fsdp2 saves (torch_dist) and resumes as if uninterrupted
    (Megatron-LM's own loader left torch's AdamW without its step count)."""
    model = [*FSDP_MODEL[:1], "6", *FSDP_MODEL[2:], "--use-torch-fsdp2"]
    _resumes_exactly(script, str(tmp_path / "ckpt"), model)


def test_pretrain_gpt_megatron_fsdp_resumes_exactly(script, tmp_path):
    """pretrain_gpt.py --use-megatron-fsdp --ckpt-format fsdp_dtensor (fp32, SwiGLU) saves and
    resumes as if uninterrupted (Megatron-LM 0.16.1's own preprocessing failed, then
    deadlocked, in fp32)."""
    model = [*FSDP_MODEL[:1], "6", *FSDP_MODEL[2:], *MEGATRON_FSDP, "optim_grads_params"]
    _resumes_exactly(script, str(tmp_path / "ckpt"), model)


def test_pretrain_gpt_megatron_fsdp_checkpoint_converts_to_hf(script, tmp_path):
    """pretrain_gpt.py's Megatron-FSDP checkpoint (--ckpt-format fsdp_dtensor, TP2 x DP2)
    converts to the HF tensors of the same training with the distributed optimizer (torch_dist)
    within 1e-5."""
    from safetensors.torch import load_file

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"stand-in": "tokenizer"}\n')
    got = {}
    for name, flags in (
        ("fsdp", [*MEGATRON_FSDP, "optim_grads_params"]),
        ("distopt", ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"]),
    ):
        ckpt, hf = tmp_path / name, tmp_path / f"{name}_hf"
        torchrun(script, *LLAMA_TP2, *flags, "--train-iters", "2", "--save", str(ckpt),
                 "--save-interval", "2", nproc=4)  # fmt: skip
        anyspeed_convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                         str(ckpt), "--save-dir", str(hf), "--hf-cfg-dir", str(tok),
                         "--model-type-hf", "llama2")  # fmt: skip
        got[name] = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(got["fsdp"]) == sorted(got["distopt"])
    for k, t in got["distopt"].items():
        assert (got["fsdp"][k] - t).abs().max() < 1e-5, k


def test_pretrain_gpt_fp8_without_transformer_engine(script):
    """``--fp8-format`` in pretrain_gpt.py without Transformer Engine: anyspeed's FP8 linears.
    TP2 + SP quantizes what DP2 does (amaxes reduced over TP): the first iteration's loss is
    the same to 2e-6 and later ones within FP8's rounding noise; the run stays within 0.1% of
    the unquantized one and is not it."""
    model = ["--train-iters", "4", "--use-cpu-initialization", "--hidden-dropout", "0",
             "--attention-dropout", "0"]  # fmt: skip
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    dp, plain = torchrun(script, *model, *fp8), torchrun(script, *model)
    tp = torchrun(script, *model, *fp8, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert sorted(tp) == list(range(1, 5))
    assert tp[1] == pytest.approx(dp[1], rel=2e-6)
    for it in range(1, 5):
        assert tp[it] == pytest.approx(dp[it], rel=1e-4), (it, tp, dp)
        assert dp[it] == pytest.approx(plain[it], rel=1e-3), (it, dp, plain)
    assert dp != plain


def test_pretrain_gpt_refuses_dualpipev_in_one_line(script):
    """Megatron-LM's training loop builds and schedules its own chunks: --schedules-method
    dualpipev behind the one line stops before process groups, naming where it runs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), *COMMON, "--pipeline-model-parallel-size", "2",
           "--schedules-method", "dualpipev"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyspeed: error:")]
    assert proc.returncode != 0 and lines, proc.stderr[-4000:]
    assert "--schedules-method dualpipev runs in `anyspeed pretrain`" in lines[0], lines[0]
