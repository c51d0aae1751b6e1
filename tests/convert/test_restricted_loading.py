"""Checkpoint files are never unpickled blindly: a planted ``__reduce__`` never runs.

A real torch_dist checkpoint (model tensor, RNG and optimizer-group sharded objects, common
state) is written in-process with Megatron's ``dist_checkpointing.save``, and a Megatron-LM
style legacy ``model_optim_rng.pt`` with ``torch.save``. A payload that would create a marker
file is planted in ``.metadata``, ``common.pt``, the sharded objects and the legacy file; every
reader -- Megatron's load as anyspeed's training calls it (through the ``safe-loading``
patches), torch's ``FileSystemReader``, ``anyspeed convert`` -- refuses with one line of
:class:`UnsafePickleError` (or CheckpointFileError), and the marker never appears. A fuzz run
mutates a valid ``.metadata`` 200 ways: each either loads or is that one error, and nothing is
executed, imported or opened (checked by an audit hook).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import pickletools
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from anyspeed import safe_pickle
from anyspeed.checkpoint.errors import CheckpointFileError, ModelRecordError
from anyspeed.features.compat.safe_loading import scan_checkpoint
from anyspeed.safe_pickle import UnsafePickleError

REFUSED = r"refusing (posix|nt)\.system"


class RunsCode:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def session():
    """A one-rank gloo group with Megatron's parallel state, and anyspeed applied."""
    from anyspeed.convert.megatron_io import megatron_session

    with megatron_session():
        yield


def _sharded(rng: object, groups: object) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", w, replica_id=0)},
        "rng_state": ShardedObject("rng_state", rng, (1,), (0,), replica_id=0),
        "optimizer": {
            "param_groups": ShardedObject("optimizer.groups", groups, (1,), (0,), replica_id=0)
        },  # fmt: skip
        "iteration": 7,
        "args": argparse.Namespace(num_layers=2, params_dtype=torch.float32),
    }


def _save(directory: Path, rng: object, groups: object) -> Path:
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True)
    dist_checkpointing.save(_sharded(rng, groups), str(directory))
    return directory


RNG = {"random": (3, tuple(range(5)), None), "torch": torch.ByteTensor([1, 2, 3])}
GROUPS = [{"lr": 1e-3, "weight_decay": 0.1, "params": [0]}]


@pytest.fixture(scope="module")
def good(session, tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("good") / "iter_0000007", RNG, GROUPS)


def _load(ckpt: Path) -> dict:
    """What anyspeed's training load does: Megatron's common-state and sharded loads."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    request = _sharded(None, None)
    request.pop("iteration"), request.pop("args")
    return common, dist_checkpointing.load(request, str(ckpt))


def _one_line(exc: BaseException, match: str) -> None:
    import re

    assert isinstance(exc, (UnsafePickleError, CheckpointFileError)), repr(exc)
    assert "\n" not in str(exc) and re.search(match, str(exc)), str(exc)


def test_valid_checkpoint_loads(good):
    scan_checkpoint(str(good))
    common, loaded = _load(good)
    assert common["iteration"] == 7 and common["args"].params_dtype is torch.float32
    assert torch.equal(loaded["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert loaded["rng_state"]["random"] == RNG["random"]
    assert torch.equal(loaded["rng_state"]["torch"], RNG["torch"])
    assert loaded["optimizer"]["param_groups"] == GROUPS


def _planted(where: str, good: Path, tmp_path: Path, marker: Path) -> Path:
    if where in ("rng", "optimizer"):
        payload = RunsCode(marker)
        return _save(tmp_path / "ckpt", payload if where == "rng" else RNG,
                     payload if where == "optimizer" else GROUPS)  # fmt: skip
    ckpt = Path(shutil.copytree(good, tmp_path / "ckpt"))
    if where == ".metadata":
        (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    else:
        common = safe_pickle.load_torch(ckpt / "common.pt")
        torch.save(dict(common, args=RunsCode(marker)), ckpt / "common.pt")
    return ckpt


@pytest.mark.parametrize("where", [".metadata", "common.pt", "rng", "optimizer"])
def test_megatron_load_refuses_planted_code(session, good, tmp_path, where):
    """Megatron's own loads, as anyspeed's training calls them, read through the allow-list."""
    marker = tmp_path / "code-ran"
    ckpt = _planted(where, good, tmp_path, marker)
    with pytest.raises(BaseException) as info:  # torch's CheckpointException is one
        _load(ckpt)
    message = safe_pickle.find_refusal(info.value)  # torch's checkpoint wraps rank failures
    assert message is not None, repr(info.value)
    _one_line(UnsafePickleError(message), REFUSED)
    # What Megatron-LM's load_checkpoint runs first (every rank, the same verdict)
    with pytest.raises(UnsafePickleError) as info:
        scan_checkpoint(str(ckpt))
    _one_line(info.value, REFUSED)
    assert not marker.exists()


def test_torch_reader_and_convert_refuse_planted_metadata(session, good, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from anyspeed.convert.dcp_io import DcpReader

    marker = tmp_path / "code-ran"
    ckpt = _planted(".metadata", good, tmp_path, marker)
    with pytest.raises(UnsafePickleError) as info:
        FileSystemReader(str(ckpt)).read_metadata()
    _one_line(info.value, r"\.metadata: " + REFUSED)
    with pytest.raises(CheckpointFileError) as info:
        DcpReader(ckpt)  # how anyspeed convert reads a torch_dist checkpoint's tensors
    _one_line(info.value, r"\.metadata: " + REFUSED)
    assert not marker.exists()


def test_rng_file_and_legacy_checkpoint_refuse_planted_code(tmp_path):
    """anyspeed's per-rank RNG file and a Megatron-LM legacy ``model_optim_rng.pt``."""
    from anyspeed.checkpoint.reads import read_common
    from anyspeed.checkpoint.torch_files import weights_only_load

    marker = tmp_path / "code-ran"
    rng = tmp_path / "pp0_tp0_cp0_dp0.pt"
    torch.save({"torch": torch.get_rng_state(), "python": RunsCode(marker)}, rng)
    with pytest.raises(CheckpointFileError) as info:
        weights_only_load(rng, str(rng))  # what the training load reads RNG files with
    _one_line(info.value, "pp0_tp0_cp0_dp0.pt: " + REFUSED)
    rank = tmp_path / "mlm" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    rank.parent.mkdir(parents=True)
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("2")
    state = {"args": argparse.Namespace(num_layers=2), "iteration": 2, "model": {},
             "optimizer": {"optimizer": {"param_groups": [RunsCode(marker)]}}}  # fmt: skip
    torch.save(state, rank)
    with pytest.raises(CheckpointFileError) as info:
        read_common(tmp_path / "mlm")
    _one_line(info.value, "model_optim_rng.pt: " + REFUSED)
    assert not marker.exists()


def test_megatron_lm_legacy_load_is_one_line_and_exit_1(tmp_path, capsys):
    """Megatron-LM's legacy load catches every Exception and exits 0; the wrapper the adaptor
    puts around it carries a refusal past that: one line, exit code 1, nothing run."""
    from anyspeed.features.compat.safe_loading import one_line_refusal, restricted_torch_load

    marker = tmp_path / "code-ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"rng_state": [RunsCode(marker)]}, path)
    load = restricted_torch_load(torch.load)

    def megatron_lm_style_load():
        try:
            return load(path, map_location="cpu")
        except Exception:  # noqa: BLE001 - as Megatron-LM's _load_base_checkpoint does
            sys.exit()

    with pytest.raises(SystemExit) as info:
        one_line_refusal(megatron_lm_style_load)()
    assert info.value.code == 1 and not marker.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyspeed: error: ") and "refusing" in err[0]
    torch.save({"ok": torch.ones(2)}, path)  # and a plain file still loads
    assert torch.equal(one_line_refusal(lambda: load(path))()["ok"], torch.ones(2))


# ------------------------------------------------------------------------------------ fuzz
_WATCHED = (
    "os.system", "subprocess.Popen", "exec", "compile", "open", "import", "os.exec",
    "os.posix_spawn", "os.spawn", "os.fork", "socket.", "ctypes.", "builtins.input",
)  # fmt: skip
_events: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _events is not None and event.startswith(_WATCHED):
        _events.append(event)


def _mutations(data: bytes, n: int, seed: int) -> list[bytes]:
    """Byte flips, truncations, opcode swaps and spliced globals (a payload's own opcodes)."""
    rng = random.Random(seed)
    ops = [(pos, op) for op, _, pos in pickletools.genops(data)]
    codes = sorted({op.code.encode("latin-1") for op in pickletools.opcodes})
    spliced = [
        b"cposix\nsystem\n", b"cbuiltins\neval\n", b"\x8c\x02os\x8c\x06system\x93",
        b"csubprocess\ncheck_output\n", b"cfunctools\npartial\n", b"R", b"b", b"\x81",
    ]  # fmt: skip
    out = []
    for i in range(n):
        b = bytearray(data)
        kind = i % 4
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 1:
            del b[rng.randrange(len(b)) :]
        elif kind == 2:
            for _ in range(rng.randint(1, 3)):
                b[rng.choice(ops)[0]] = rng.choice(codes)[0]
        else:
            at = rng.choice(ops)[0]
            b[at:at] = rng.choice(spliced) + (b"(tR" if rng.random() < 0.5 else b"")
        out.append(bytes(b))
    return out


def test_fuzzed_metadata_never_runs_code(good):
    global _events
    data = (good / ".metadata").read_bytes()
    assert type(safe_pickle.loads(data, ".metadata")).__name__ == "Metadata"
    sys.addaudithook(_audit)  # stays installed, inert outside this test
    results = {"loaded": 0, "refused": 0}
    _events = []
    try:
        for case in _mutations(data, 200, seed=19):
            try:
                safe_pickle.loads(case, ".metadata")
                results["loaded"] += 1
            except UnsafePickleError as exc:
                assert "\n" not in str(exc) and str(exc).startswith(".metadata: ")
                results["refused"] += 1
        seen, _events = _events, None
    finally:
        _events = None
    assert not seen, f"unpickling triggered {sorted(set(seen))}"
    assert results["refused"] > 100, results


# ------------------------------------------------------------ Megatron-LM's checkpoints convert
def test_checkpoint_with_megatron_lm_args_converts_to_hf(tmp_path):
    """Megatron-LM stores ``args`` (argparse.Namespace with enums and dtypes) where anyspeed
    stores ``anyspeed_model``: the restricted unpickler reads it, the architecture comes from
    it (family from --model-type-hf) and only tokenizer files come from the user."""
    import signal

    from safetensors.torch import load_file

    from anyspeed.convert import hf_to_megatron, megatron_to_hf
    from anyspeed.models import get_preset
    from anyspeed.models.hf import preset_from_hf
    from helpers import convert_ranks

    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-qwen2.5")
    mg = hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2, ckpt_format="legacy")
    p = get_preset("tiny-qwen2.5")
    args = argparse.Namespace(  # Megatron-LM's names for the architecture, and other values
        num_layers=p.num_layers,
        hidden_size=p.hidden_size,
        ffn_hidden_size=p.ffn_hidden_size,
        num_attention_heads=p.num_attention_heads,
        group_query_attention=True,
        num_query_groups=p.num_query_groups,
        kv_channels=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(p.rotary_base),
        rotary_percent=1.0,
        normalization="RMSNorm",
        layernorm_epsilon=p.norm_epsilon,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=False,
        untie_embeddings_and_output_weights=False,
        padded_vocab_size=p.vocab_size,
        vocab_size=None,
        use_rope_scaling=False,
        params_dtype=torch.float32,
        exit_signal=signal.SIGTERM,
        tensor_model_parallel_size=2,
        moe_layer_freq=1,  # Megatron-LM stores the int (anyspeed the string "1")
    )
    for rank in sorted((mg / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt")):
        state = safe_pickle.load_torch(rank)
        state = {"model": state["model"], "args": args, "iteration": 1, "checkpoint_version": 3.0}
        torch.save(state, rank)
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(tmp_path / "hf" / "tokenizer.json", tok)
    with pytest.raises(ModelRecordError, match="llama models have add_qkv_bias=False, the che"):
        megatron_to_hf(mg, tmp_path / "wrong", tok, model_type_hf="llama2")
    out = megatron_to_hf(mg, tmp_path / "out", tok, model_type_hf="qwen25")
    want, got = load_file(tmp_path / "hf" / "model.safetensors"), {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((out / "config.json").read_text())
    orig = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert preset_from_hf(cfg) == preset_from_hf(orig)
    assert (out / "tokenizer.json").is_file()
    # --hf-cfg-dir holding the model's own config.json: the same model, however each spells it
    again = megatron_to_hf(mg, tmp_path / "again", tmp_path / "hf", model_type_hf="qwen25")
    assert json.loads((again / "config.json").read_text()) == orig


def test_a_refused_metadata_is_the_error_where_torch_drops_it(good, tmp_path):
    """torch before 2.13 swallows ``read_metadata``'s error and fails on "metadata is None"
    (seen with 2.11); the wrapped ``_load_state_dict`` fails with the refusal instead."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from anyspeed.features.compat import safe_loading

    ckpt = _planted(".metadata", good, tmp_path, tmp_path / "code-ran")

    def torch_before_2_13(*_: object) -> None:
        try:
            safe_loading.read_metadata(FileSystemReader(str(ckpt)))
        except Exception:  # noqa: BLE001 - what torch 2.11 does
            pass
        raise AssertionError("metadata is None")

    with pytest.raises(UnsafePickleError) as info:
        safe_loading.carrying_refusal(torch_before_2_13)()
    _one_line(info.value, REFUSED)
    assert not (tmp_path / "code-ran").exists()

    def other_failure(*_: object) -> None:
        raise KeyError("not a refusal")

    with pytest.raises(KeyError):  # an error that is no refusal passes through as it is
        safe_loading.carrying_refusal(other_failure)()
