"""One flag path: the features' parsers, the registry, the attention-core seam, the pure adaptor
and the import rule of ``anyspeed.features``."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from anyspeed import features as F
from anyspeed.device import DeviceInfo
from anyspeed.features.compat.accepted_flags import NOOPS
from anyspeed.patching import PatchManager

CPU = DeviceInfo("cpu", "gloo", "test")
SRC = Path(__file__).resolve().parents[1] / "src" / "anyspeed"

# MindSpeed-LLM's Qwen2.5-7B pretrain script: its kernel / performance switches.
QWEN_KERNEL_FLAGS = [
    "--use-mcore-models", "--use-flash-attn", "--use-fused-swiglu", "--use-fused-rmsnorm",
    "--use-fused-rotary-pos-emb", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--attention-softmax-in-fp32", "--distributed-backend", "nccl",
]  # fmt: skip


def test_standalone_parser_reads_megatron_flags_and_ignores_the_rest():
    args = F.parse_args(["--tensor-model-parallel-size", "2", "--data-path", "x", "--num-layers",
                         "4", "--group-query-attention", "--use-flash-attn"])  # fmt: skip
    assert args.tensor_model_parallel_size == 2 and args.num_layers == 4
    assert args.group_query_attention and args.use_flash_attn
    assert args.seq_length is None and not args.sequence_parallel
    assert not hasattr(args, "_argv") and not hasattr(args, "data_path")


def test_add_arguments_adds_own_flags_only_and_keeps_existing_ones():
    p = argparse.ArgumentParser()
    p.add_argument("--use-flash-attn", action="store_true", help="Megatron-LM's own")
    p.add_argument("--transformer-impl", default="transformer_engine")
    F.add_arguments(p)
    have = p._option_string_actions
    assert "--optimization-level" in have and "--context-parallel-algo" in have
    for flag, _ in F.MEGATRON_FLAGS:  # read by features, owned by Megatron-LM / pretrain
        assert flag not in have, flag
    assert have["--use-flash-attn"].help == "Megatron-LM's own"
    args = p.parse_args(QWEN_KERNEL_FLAGS)
    assert args.transformer_impl == "transformer_engine" and args.distributed_backend == "nccl"
    assert args.use_fused_swiglu and args.use_mcore_models


def test_accepted_flags_are_all_noted():
    feature = F.registry.get("accepted-flags")
    notes = feature.flag_notes()
    assert set(NOOPS) <= set(notes) and all(notes.values())
    for flag in ("--use-flash-attn", "--use-fused-swiglu", "--use-fused-rmsnorm",
                 "--use-fused-rotary-pos-emb"):  # fmt: skip
        assert notes[flag].startswith("not a no-op"), flag
    for flag in QWEN_KERNEL_FLAGS:
        assert not flag.startswith("--") or flag in notes, flag


def test_registry_is_explicit_ordered_and_unique():
    names = [f.name for f in F.features()]
    assert len(names) == len(set(names))
    assert names[0] == "device-compat" and names[-1] == "attention-core"
    assert [f.name for f in F.registry.build()] == names  # a fresh build, same order
    levels = [f.level for f in F.features() if f.name != "attention-core"]
    assert levels == sorted(levels)


@pytest.mark.parametrize(
    "argv,owner,core",
    [
        (["--optimization-level", "0"], None, None),
        (["--optimization-level", "1"], "flash-attention", "SDPAttention"),
        ([], "flash-attention", "SDPAttention"),
        (["--context-parallel-size", "2"], "context-parallel", "CPAttention"),
    ],
)
def test_one_owner_of_the_attention_core(argv, owner, core):
    args = F.parse_args(argv)
    seam = F.registry.get("attention-core")
    chosen = seam.choice(args, CPU)
    assert (chosen.name if chosen else None) == owner
    pm = PatchManager()
    for feature in F.enabled_features(args, CPU):
        feature.register_patches(pm, args, CPU)
    replaced = [p for p in pm.patches() if p.target.endswith(".DotProductAttention")]
    assert [p.obj.__name__ for p in replaced] == ([core] if core else [])
    assert all(p.feature == "attention-core" for p in replaced)


def test_feature_error_is_one_line_from_the_command_line():
    code = "from anyspeed import adaptor; adaptor.apply_command_line(['--optimization-level', '7'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("anyspeed: error: ") and "\n" not in out.stderr.strip()


def test_adaptor_is_pure_and_the_shim_applies():
    code = (
        "import sys, torch; from anyspeed import adaptor; assert adaptor.state() is None; "
        "import anyspeed.megatron_adaptor as shim; st = adaptor.state(); "
        "print(st is not None and shim.state() is st and st.args.tensor_model_parallel_size)"
    )
    out = subprocess.run([sys.executable, "-c", code, "--tensor-model-parallel-size", "1"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_features_never_import_upward_nor_the_adaptor():
    banned = ("training", "models", "convert", "data", "cli", "adaptor", "megatron_adaptor")
    for path in (SRC / "features").rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "anyspeed" and len(parts) > 1:
                assert parts[1] not in banned, f"{path.relative_to(SRC)} imports {name}"
            assert not name.startswith("megatron.training") or path.name.startswith(
                "megatron_lm"
            ), f"{path.relative_to(SRC)} imports {name}"


def test_only_the_shim_imports_the_shim():
    for path in SRC.rglob("*.py"):
        if path.name != "megatron_adaptor.py":
            assert "anyspeed.megatron_adaptor" not in _imports(path), path.relative_to(SRC)
