"""Helpers for the converter tests: tiny random HF models, and functions that run in spawned
ranks (importable by name) to convert and to run Megatron's GPTModel at a TP/PP layout."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from anyspeed.models import get_preset
from anyspeed.models.hf import hf_config


def tiny_hf_model(
    directory: str | Path, preset: str, seed: int = 0, shard: str | None = None, **overrides
) -> dict:
    """Save a random ``transformers`` model of the tiny preset (weights, norms and biases all
    random, so a wrong mapping shows in the logits) plus stand-in tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config(get_preset(preset)), **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routing: a wrong mapping shows
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(directory), **kw)
    (Path(directory) / "tokenizer.json").write_text('{"stand-in": "tokenizer"}\n')
    (Path(directory) / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')
    return cfg


def hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's ``*.safetensors`` files, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def legacy_round_trip(root: Path, layers: int, pp: int, counts: list[int], **placed: str) -> None:
    """A tiny Qwen2.5 of ``layers`` layers, HF -> legacy Megatron at PP ``pp`` placed by
    ``placed`` (``num_layer_list=`` / ``noop_layers=``) -> HF, bit for bit; rank file ``s``
    holds ``counts[s]`` layers, numbered from 0."""
    from anyspeed.convert import hf_to_megatron, megatron_to_hf

    tiny_hf_model(root / "hf", "tiny-qwen2.5", seed=1, num_hidden_layers=layers)
    hf_to_megatron(root / "hf", root / "mg", pp=pp, ckpt_format="legacy", **placed)
    for stage, n in enumerate(counts):
        sd = torch.load(root / f"mg/iter_0000001/mp_rank_00_{stage:03d}/model_optim_rng.pt")
        held = {k.split(".")[2] for k in sd["model"] if k.startswith("decoder.layers.")}
        assert held == {str(i) for i in range(n)}, (stage, held)
    megatron_to_hf(root / "mg", root / "back", root / "hf")
    a, b = hf_tensors(root / "hf"), hf_tensors(root / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def add_mtp_layers(directory: str | Path, n: int = 1, seed: int = 0) -> None:
    """Append ``n`` random multi-token prediction layers to a saved DeepSeek-V3 model as its
    Hugging Face checkpoints keep them (transformers' model has none): HF layers after the last,
    each a decoder layer like the last plus enorm, hnorm, eh_proj and shared_head.norm, and
    copies of the embedding and the output layer."""
    from safetensors.torch import load_file, save_file

    path = Path(directory) / "model.safetensors"
    tensors = load_file(str(path))
    layers = 1 + max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    last, g = f"model.layers.{layers - 1}.", torch.Generator().manual_seed(seed)
    h = tensors["model.norm.weight"].shape[0]

    def rand(shape, norm=False):
        noise = torch.randn(shape, generator=g)
        return 1 + 0.2 * noise if norm else 0.1 * noise

    for j in range(n):
        at = f"model.layers.{layers + j}."
        for k, t in list(tensors.items()):
            if k.startswith(last):
                tensors[at + k[len(last) :]] = rand(t.shape, "norm" in k)
        for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[at + k] = rand((h,), norm=True)
        tensors[at + "eh_proj.weight"] = rand((h, 2 * h))
        tensors[at + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[at + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _build(ckpt: str, tp: int, pp: int, ep: int = 1, sp: bool = False,
           num_layer_list: str | None = None, etp: int | None = None):  # fmt: skip
    from megatron.core import parallel_state as ps

    from anyspeed.checkpoint.record import read_model
    from anyspeed.layout import Layout, uneven_stages
    from anyspeed.models import gpt

    preset = read_model(ckpt)
    stages = uneven_stages(pp, None, None, num_layer_list)
    model = gpt.build(
        preset,
        gpt.transformer_config(
            preset, Layout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sp, **stages)
        ),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model


def _resave(model, source: str, out: str) -> None:
    """Save ``model`` with Megatron's default ``dist_checkpointing.save`` under ``out``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.reads import read_common

    release = Path(out) / "release"
    if dist.get_rank() == 0:
        release.mkdir(parents=True)
        (Path(out) / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), **read_common(source)},
                            str(release))  # fmt: skip


def _logits(model, tokens):
    from anyspeed.inference.logits import forward_logits

    return forward_logits([model], tokens)  # Megatron's schedule + TP gather, at any layout


def layout_logits(cases: dict[str, dict], tp: int, pp: int, tokens, ep: int = 1,
                  sp: bool = False, etp: int | None = None) -> dict:  # fmt: skip
    # a case's "stages": MindSpeed-LLM's --num-layer-list for uneven pipeline stages
    """For each case: logits of GPTModel at TP x PP loaded (a) with dist_checkpointing from the
    torch_dist checkpoint, as ``pretrain --load`` does, and (b) with ``load_state_dict(strict=
    True)`` from this rank's legacy file, if given; plus legacy shapes that differ from the
    model's."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from anyspeed.checkpoint.files import rank_dir_name
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout

    init_distributed(Layout(tp=tp, pp=pp, ep=ep, etp=etp), seed=0)
    out = {}
    for name, case in cases.items():
        stages = case.get("stages") if pp > 1 else None
        model = _build(case["torch_dist"], tp, pp, ep, sp, stages, etp)
        release = str(Path(case["torch_dist"]) / "release")
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, release)
        model.load_state_dict(state["model"])
        res = {"dist": _logits(model, tokens)}
        if case.get("resave"):  # Megatron's own writer, chunks split by this layout
            _resave(model, case["torch_dist"], case["resave"])
        if case.get("legacy"):
            r, s = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
            x = ps.get_expert_model_parallel_rank()
            rank_dir = rank_dir_name(r, s, x, pp, ep)
            path = Path(case["legacy"]) / "iter_0000001" / rank_dir / "model_optim_rng.pt"
            state = torch.load(path, weights_only=True)["model"]
            expect = model.state_dict()
            res["shape_mismatch"] = sorted(
                k
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(expect[k].shape)
            )
            model.load_state_dict(state, strict=True)
            res["legacy"] = _logits(model, tokens)
        out[name] = res
    return out


def layouts_logits(runs: list[dict], tokens) -> list[dict]:
    """:func:`layout_logits` for several layouts in turn, in one process group."""
    return [layout_logits(tokens=tokens, **run) for run in runs]


def convert_all(cases: dict[str, dict], tokens, cli_case: str) -> dict[str, dict]:
    """In one process: HF -> torch_dist (the CLI with --verify for ``cli_case``), TP1 logits
    from the result, torch_dist -> HF."""
    from anyspeed.commands.convert import main as cli_main
    from anyspeed.convert import hf_to_megatron, mapped, megatron_to_hf
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout

    init_distributed(Layout(), seed=0)
    mapped.MIN_RANGE = 1  # every mapped buffer file to file (the tiny tensors are below 64 KiB)
    out = {}
    for name, case in cases.items():
        res = {}
        if name == cli_case:
            buf = io.StringIO()
            argv = [
                "--load-model-type",
                "hf",
                "--save-model-type",
                "mg",
                "--load-dir",
                case["hf"],
                "--save-dir",
                case["torch_dist"],
                "--verify",
            ]
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                res["rc"] = cli_main(argv)
            res["stdout"] = buf.getvalue()
        else:
            hf_to_megatron(
                case["hf"],
                case["torch_dist"],
                tp=case.get("tp", 1),
                make_vocab_size_divisible_by=case.get("divisible_by", 1),
            )
        megatron_to_hf(case["torch_dist"], case["hf_from_dist"], hf_cfg_dir=case["hf"])
        res.update(layout_logits({name: case}, 1, 1, tokens)[name])
        out[name] = res
    return out


def checkpoint_logits(ckpt: str, model: dict, tokens) -> torch.Tensor:
    """Logits of GPTModel (TP1/PP1) built from ``model`` (``ModelConfig.to_dict()`` of the
    architecture the test asked for, not the checkpoint's record) and loaded with Megatron's
    own ``dist_checkpointing.load`` from the iteration directory ``ckpt``'s tracker names."""
    from megatron.core import dist_checkpointing

    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    init_distributed(Layout(), seed=0)
    cfg = ModelConfig.from_dict(model)
    net = gpt.build(cfg, gpt.transformer_config(cfg, Layout()))
    it = (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip()
    state = dist_checkpointing.load({"model": net.sharded_state_dict()},
                                    str(Path(ckpt) / f"iter_{int(it):07d}"))  # fmt: skip
    net.load_state_dict(state["model"])
    return _logits(net, tokens)
