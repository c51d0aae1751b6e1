"""Bad input to ``anyspeed convert``: one clear line, and nothing left under the final name.

Every check fails before Megatron starts, so these run in the test process itself.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from anyspeed import quiet
from anyspeed.checkpoint.errors import CheckpointFileError
from anyspeed.commands.convert import main as cli_main
from anyspeed.convert import ConvertError, hf_to_megatron, megatron_to_hf
from helpers import convert_ranks


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama"
    convert_ranks.tiny_hf_model(d, "tiny-llama3", shard="40KB")
    return d


@pytest.fixture
def hf(hf_model, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(hf_model, d)
    return d


def _edit_config(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def _fails(fn, match: str, out: Path, *args, error=ConvertError, **kwargs) -> str:
    with pytest.raises(error, match=match) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))
    return msg


def test_unsupported_architecture_lists_the_supported(hf, tmp_path):
    _edit_config(hf, architectures=["Glm4ForCausalLM"], model_type="glm4")
    msg = _fails(hf_to_megatron, "unsupported architecture Glm4ForCausalLM", tmp_path / "mg",
                 hf, tmp_path / "mg")  # fmt: skip
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                 "Glm4MoeForCausalLM"):  # fmt: skip
        assert arch in msg


def test_moe_config_without_experts_is_one_line(hf, tmp_path):
    _edit_config(hf, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    _fails(hf_to_megatron, "config.json has no num_experts", tmp_path / "mg", hf, tmp_path / "mg")


def test_missing_shard(hf, tmp_path):
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (hf / shard).unlink()
    _fails(hf_to_megatron, f"missing shard {shard}", tmp_path / "mg", hf, tmp_path / "mg")


def test_shape_that_does_not_match_the_config(hf, tmp_path):
    _edit_config(hf, intermediate_size=192)
    _fails(hf_to_megatron, r"down_proj.weight has shape \[64, 176\], config.json implies "
           r"\[64, 192\]", tmp_path / "mg", hf, tmp_path / "mg")  # fmt: skip


def test_tp_that_cannot_shard_heads_or_kv_groups(hf, tmp_path):
    out = tmp_path / "mg"
    _fails(hf_to_megatron, "--num-attention-heads 4 is not divisible by "
           "--target-tensor-parallel-size 3", out, hf, out, tp=3)  # fmt: skip
    _fails(hf_to_megatron, "--num-layers 2 is not divisible", out, hf, out, pp=4)
    _edit_config(hf, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    _fails(hf_to_megatron, "--num-query-groups 3 and --target-tensor-parallel-size 2 must "
           "divide one another", out, hf, out, tp=2, ckpt_format="legacy")  # fmt: skip


def test_existing_output_directory_is_left_alone(hf, tmp_path):
    out = tmp_path / "mg"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConvertError, match="already exists"):
        hf_to_megatron(hf, out, ckpt_format="legacy")
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_model_type_hf_must_match_config(hf, tmp_path):
    _fails(hf_to_megatron, "--model-type-hf qwen3 does not match config.json "
           r"\(LlamaForCausalLM\)", tmp_path / "mg", hf, tmp_path / "mg",
           model_type_hf="qwen3")  # fmt: skip


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_objects_are_refused_and_failures_leave_no_output(hf, tmp_path):
    legacy = hf_to_megatron(hf, tmp_path / "legacy", tp=2, ckpt_format="legacy")
    rank1 = legacy / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(rank1, weights_only=True)
    marker = tmp_path / "code-ran"
    state["args"] = _RunsCode(marker)  # a class no checkpoint holds
    torch.save(state, rank1)
    _fails(megatron_to_hf, r"mp_rank_01.*refusing (posix|nt)\.system", tmp_path / "out", legacy,
           tmp_path / "out", error=CheckpointFileError)  # fmt: skip
    assert not marker.exists()
    rank1.write_bytes(rank1.read_bytes()[:1000])  # truncated: fails mid-conversion
    _fails(megatron_to_hf, "mp_rank_01", tmp_path / "out", legacy, tmp_path / "out",
           error=CheckpointFileError)  # fmt: skip


def test_truncated_safetensors_shard(hf, tmp_path):
    """The last shard cut short: one line naming it, mid-conversion, and no output left."""
    shard = sorted(hf.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    _fails(hf_to_megatron, f"{shard.name}: truncated", tmp_path / "out", hf, tmp_path / "out",
           ckpt_format="legacy")  # fmt: skip


def test_torch_dist_metadata_is_never_unpickled_blindly(hf, tmp_path):
    """``.metadata`` of a torch_dist checkpoint is a pickle: only the checkpoint-metadata
    classes are allowed, so a crafted one is refused before any of its code runs."""
    from anyspeed.checkpoint.reads import read_common

    legacy = hf_to_megatron(hf, tmp_path / "legacy", ckpt_format="legacy")
    ckpt = tmp_path / "dist"
    (ckpt / "release").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("release")
    (ckpt / "release" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save(read_common(legacy), ckpt / "release" / "common.pt")
    marker = tmp_path / "code-ran"
    (ckpt / "release" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _fails(megatron_to_hf, r"\.metadata: refusing (posix|nt)\.system", tmp_path / "out", ckpt,
           tmp_path / "out", error=CheckpointFileError)  # fmt: skip
    assert not marker.exists()


@pytest.mark.parametrize("text, match", [
    ("latest", "expected an iteration number or 'release', got 'latest'"),
    ("7", "latest_checkpointed_iteration.txt names 7 but .*/iter_0000007 does not exist"),
])  # fmt: skip
def test_bad_tracker_is_one_line(hf, tmp_path, text, match):
    legacy = hf_to_megatron(hf, tmp_path / "legacy", ckpt_format="legacy")
    (legacy / "latest_checkpointed_iteration.txt").write_text(text + "\n")
    _fails(
        megatron_to_hf, match, tmp_path / "out", legacy, tmp_path / "out", error=CheckpointFileError
    )


def test_tracker_files(tmp_path):
    from anyspeed.checkpoint import files as cf

    assert cf.read_tracker(tmp_path) is None
    cf.write_tracker(tmp_path, 20)
    assert (tmp_path / cf.TRACKER).read_text() == "20" and cf.read_tracker(tmp_path) == 20
    assert cf.iteration_dir(tmp_path, 20) == str(tmp_path / "iter_0000020")
    cf.write_tracker(tmp_path, "release")
    assert cf.read_tracker(tmp_path) == "release"
    assert cf.iteration_dir(tmp_path, "release") == str(tmp_path / "release")
    assert sorted(p.name for p in tmp_path.iterdir()) == [cf.TRACKER]  # no temporary left


def test_hf_cfg_dir_of_another_model(hf, tmp_path):
    legacy = hf_to_megatron(hf, tmp_path / "legacy", ckpt_format="legacy")
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    _edit_config(other, num_hidden_layers=3)
    _fails(megatron_to_hf, "describes another model \\(num_layers 3", tmp_path / "out", legacy,
           tmp_path / "out", other)  # fmt: skip


def test_cli_prints_one_line(hf, tmp_path, capsys):
    out = tmp_path / "mg"
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
            "--save-dir", str(out), "--target-tensor-parallel-size", "3"]  # fmt: skip
    assert cli_main(argv) == 1
    # Megatron was loaded before the check: anyspeed's one notice may precede the error line.
    err = capsys.readouterr().err.strip().replace(quiet.notice() + "\n", "")
    assert err.startswith("anyspeed convert: error: ") and "\n" not in err
    assert not out.exists()
    assert cli_main([*argv, "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "anyspeed convert: error: unrecognized arguments: --no-such-flag"


@pytest.mark.parametrize("text, match", [
    ('{"hidden_size": 64,', r"config.json: not valid JSON \(Expecting"),
    ("[1, 2]", "config.json: not a JSON object"),
    ("\xff", "config.json: not valid JSON"),
])  # fmt: skip
def test_config_json_that_is_not_a_json_object(hf, tmp_path, text, match):
    (hf / "config.json").write_bytes(text.encode("latin-1"))
    _fails(hf_to_megatron, match, tmp_path / "mg", hf, tmp_path / "mg")


@pytest.mark.parametrize("edit, match", [
    ({"hidden_size": None}, "config.json has no hidden_size"),
    ({"num_hidden_layers": "2"}, "config.json num_hidden_layers is '2', not a whole number"),
    ({"vocab_size": 0}, "config.json vocab_size is 0, not a whole number >= 1"),
    ({"rms_norm_eps": [1e-6]}, r"config.json rms_norm_eps is \[1e-06\], not a number"),
    ({"architectures": "LlamaForCausalLM"}, "config.json architectures is 'LlamaForCausalLM'"),
    ({"rope_scaling": [1]}, "rope_scaling is not an object"),
])  # fmt: skip
def test_config_fields_missing_or_of_the_wrong_type(hf, tmp_path, edit, match):
    """A missing ``hidden_size`` said only "error: hidden_size"; a wrong type was a traceback."""
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (hf / "config.json").write_text(json.dumps(cfg))
    _fails(hf_to_megatron, match, tmp_path / "mg", hf, tmp_path / "mg")


@pytest.mark.parametrize("index", [{}, {"weight_map": []}, {"weight_map": {}},
                                   {"weight_map": {"model.norm.weight": ["a"]}}])  # fmt: skip
def test_index_without_weight_map(hf, tmp_path, index):
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(hf_to_megatron, "index.json: no weight_map", tmp_path / "mg", hf, tmp_path / "mg")


def test_max_shard_size_is_parsed_like_transformers():
    from anyspeed.convert.hf_io import parse_size

    sizes = {"5GB": 5 * 10**9, "500MB": 5 * 10**8, "2GiB": 2 * 2**30, "40kb": 40_000,
             "1000": 1000, " 1.5 GB ": 15 * 10**8, 4096: 4096}  # fmt: skip
    assert {k: parse_size(k) for k in sizes} == sizes
    for bad in ("5XB", "", "GB", "-1", "0", "1e9", "5 G B", "9" * 400):
        with pytest.raises(ConvertError, match="--max-shard-size .*: expected a size such as"):
            parse_size(bad)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli_main(argv)
    err = capsys.readouterr().err.strip().replace(quiet.notice() + "\n", "")
    assert err.startswith("anyspeed convert: error: ") and "\n" not in err, err
    return code, err


def test_cli_checks_flags_before_any_work(hf, tmp_path, capsys):
    """A bad --max-shard-size or a --save-dir that cannot be created: one line, exit code 2,
    before the checkpoint is read (a missing --load-dir is not even noticed)."""
    argv = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
            str(tmp_path / "nothing"), "--save-dir", str(tmp_path / "out")]  # fmt: skip
    code, err = _cli([*argv, "--max-shard-size", "5XB"], capsys)
    assert code == 2 and "--max-shard-size '5XB': expected a size such as 5GB" in err
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode; /sys refuses new entries even to root
        ro = Path("/sys")
    out = ro / "new" / "out"
    code, err = _cli([*argv[:-1], str(out)], capsys)
    assert code == 2 and f"--save-dir {out}: cannot create it in {ro}" in err
    assert not out.exists() and not (tmp_path / "out").exists()


def test_cli_truncated_safetensors_is_one_line_before_megatron_runs(hf, tmp_path, capsys):
    """A truncated shard gave an 88-line traceback from the torch_dist writer's ranks; now its
    header check fails when the directory is opened."""
    shard = sorted(hf.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    out = tmp_path / "mg"
    code, err = _cli(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                      str(hf), "--save-dir", str(out)], capsys)  # fmt: skip
    assert code == 1 and f"{shard}: truncated: tensor" in err
    assert not out.exists()


@pytest.mark.parametrize("direction", ["hf-torch_dist", "hf-legacy", "mg-hf"])
def test_file_size_limit_is_one_line_and_keeps_nothing(hf, tmp_path, capsys, direction):
    """Under a file-size limit (a full disk fails alike) every direction stops with one line
    naming the output, and leaves no partial output behind (torch's writers wrap the OS error
    in their own exceptions, one of them not even an Exception)."""
    import resource

    src = hf
    if direction == "mg-hf":
        src = tmp_path / "mg"
        assert cli_main(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir",
                         str(hf), "--save-dir", str(src)]) == 0  # fmt: skip
    out = tmp_path / "out"
    kind = direction.split("-")
    argv = ["--load-model-type", kind[0], "--save-model-type", "mg" if kind[0] == "hf" else "hf",
            "--load-dir", str(src), "--save-dir", str(out)]  # fmt: skip
    if kind[-1] == "legacy":
        argv += ["--ckpt-format", "legacy"]
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # Python ignores SIGXFSZ
    try:
        rc = cli_main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "Transformer Engine" not in x]
    assert rc == 1 and len(err) == 1, err
    assert "File too large" in err[0] and str(out) in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
