"""``anyspeed pretrain --load <HF dir>`` of a tiny random DeepSeek-V3 with one multi-token
prediction layer (group-limited sigmoid routing with the expert-bias correction, low-rank
queries, YaRN): the first loss equals transformers' loss, and the first MTP loss an independent
plain-PyTorch MTP built from transformers' own decoder layer, each within 1e-5; at TP2 (with
sequence parallelism), and PP2 (MTP on the last stage, its embedding copy tied to the first's)
and EP2 with ``-m slow``, loss, MTP loss and grad norm equal the one-process run within 1e-5
over three steps. (TP2 found Megatron's MLA leaving the rotary key's gradient unsummed.)"""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss

from helpers import convert_ranks

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
          "--no-progress-bar", "--mtp-loss-scaling-factor", "0.3"]  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--num-layer-list", "2,1"],
}
EP2 = [
    "--expert-model-parallel-size",
    "2",
    "--num-experts",
    "16",
    "--moe-token-dispatcher-type",
    "alltoall",
]  # (the adaptor checks the layout before --load's config.json is read)
MTP = "mtp_1 loss"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds3_train")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    convert_ranks.tiny_hf_model(root / "hf", "tiny-deepseek-v3", seed=3)
    convert_ranks.add_mtp_layers(root / "hf", seed=5)
    for stand_in in ("tokenizer.json", "tokenizer_config.json"):  # token ids only
        (root / "hf" / stand_in).unlink()
    argv = ["--load", str(root / "hf"), "--data-path", corpus, *COMMON]
    (one,) = run_many(1, [argv + ["--save", str(root / "one")]])
    (two,) = run_many(2, [argv + LAYOUTS["tp2-sp"] + ["--save", str(root / "tp2-sp")]])
    return root, argv, one, two


def _hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def _mtp_reference(hf_dir, model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP depth 1 in plain PyTorch: position i joins the main model's output
    hidden state (after the final norm, as Megatron and vLLM take it) with token i+1's
    embedding, runs a decoder layer (transformers' own, loaded with HF layer L's weights) and
    predicts label i+1 (token i+2)."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    n = model.config.num_hidden_layers
    w = {k[len(f"model.layers.{n}.") :]: v for k, v in load_file(str(hf_dir / "model.safetensors"))
         .items() if k.startswith(f"model.layers.{n}.")}  # fmt: skip
    layer = DeepseekV3DecoderLayer(model.config, n).eval()
    experts = range(model.config.n_routed_experts)  # stored per expert, fused in the module
    fused = {
        "mlp.experts.gate_up_proj": torch.stack([torch.cat(
            [w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]])
            for e in experts]),
        "mlp.experts.down_proj": torch.stack([w[f"mlp.experts.{e}.down_proj.weight"]
                                              for e in experts]),
    }  # fmt: skip
    own = {k: v for k, v in w.items() if k in layer.state_dict()}
    layer.load_state_dict({**own, **fused}, strict=True)
    h = model.model(input_ids=tokens).last_hidden_state  # after the final norm, as vLLM's

    def rms(x, weight):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        return weight * x

    nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    emb = model.model.embed_tokens(nxt)
    x = (
        torch.cat([rms(emb, w["enorm.weight"]), rms(h, w["hnorm.weight"])], -1)
        @ w["eh_proj.weight"].T
    )
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    y = layer(x, attention_mask=None, position_ids=pos,
              position_embeddings=model.model.rotary_emb(x, pos))  # fmt: skip
    y = y[0] if isinstance(y, tuple) else y
    logits = model.lm_head(rms(y, w["shared_head.norm.weight"]))
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    return ce


def test_first_losses_equal_transformers_and_a_plain_pytorch_mtp(runs, monkeypatch):
    from anyspeed.stages.common.gpt_data import build_datasets

    root, argv, one, _ = runs
    model = _hf_model(root / "hf")
    model.config._attn_implementation = "sdpa"  # attention_mask None: causal
    want, run = hf_first_loss(model, argv, monkeypatch)
    assert one["loss"][0] == pytest.approx(want, rel=1e-5)
    train = build_datasets(run.args, run.tokenizer)[0]
    mtp = []
    with torch.no_grad():
        for mb in ([0, 1], [2, 3]):
            tokens = torch.stack([train[i]["tokens"] for i in mb])
            labels = torch.stack([train[i]["labels"] for i in mb])
            mtp.append(float(_mtp_reference(root / "hf", model, tokens, labels)))
    assert one["metrics"][MTP][0] == pytest.approx(sum(mtp) / 2, rel=1e-5)
    assert len(set(one["loss"])) == 3 and one["metrics"][MTP][2] != one["metrics"][MTP][0]


def _same(run: dict, one: dict) -> None:
    _close(run["loss"], one["loss"])
    _close(run["metrics"][MTP], one["metrics"][MTP])
    _close(run["grad_norm"], one["grad_norm"])


def test_tp2_sp_equals_one_process(runs):
    _, _, one, two = runs
    _same(two, one)


@pytest.mark.slow  # one more two-process run
def test_pp2_equals_one_process(runs, tmp_path):
    _, argv, one, _ = runs
    (run,) = run_many(2, [argv + LAYOUTS["pp2"] + ["--save", str(tmp_path / "pp2")]])
    _same(run, one)


@pytest.mark.slow  # two more processes' run
def test_ep2_equals_one_process(runs, tmp_path):
    _, argv, one, _ = runs
    (run,) = run_many(2, [argv + EP2 + ["--save", str(tmp_path / "ep2")]])
    _same(run, one)
