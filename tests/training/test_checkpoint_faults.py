"""Broken checkpoints under ``--load`` and failing saves: one line, every rank exits, nothing lost.

One spawned group of two ranks runs the faults that need a process group, each case through
the command's ``main``: a disk that fills up while rank 1 writes the second checkpoint, a
``--save`` directory that turns read-only before rank 0 stages the first one, and a saved RNG
state that only rank 1 cannot restore. The first checkpoint those runs save is then the good
one that the in-process cases break, file by file, for the checks that run before any process
group starts.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
from test_pretrain import base_args, write_corpus

from anyspeed.checkpoint.files import LOCK, TRACKER
from anyspeed.commands.train import pretrain as main
from anyspeed.testing import run_distributed
from helpers import checkpoint_ranks

ITER = "iter_0000001"


def _args(prefix: str, iters: int) -> list[str]:
    argv = base_args(prefix, iters) + ["--nproc-per-node", "2"]
    argv[argv.index("--num-layers") + 1] = "2"
    return argv


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The two-rank runs (rank 0's and rank 1's results per case) and their directories."""
    root = tmp_path_factory.mktemp("ckfaults")
    prefix = write_corpus(str(root / "c_text_document"), docs=60)
    disk, perm, rng = str(root / "disk"), str(root / "perm"), str(root / "rng")
    os.makedirs(os.path.join(disk, "iter_0000009.tmp"))  # a save killed half-way
    open(os.path.join(disk, "iter_0000009.tmp", "__0_0.distcp"), "wb").write(b"x" * 100)
    open(os.path.join(disk, TRACKER + ".tmp"), "w").write("9")
    dead = os.path.join(disk, f".from-hf-m-0a.partial-{_dead_pid()}")  # a killed conversion
    os.makedirs(dead)
    open(os.path.join(dead, "model.safetensors"), "wb").write(b"x" * 100)
    os.makedirs(os.path.join(disk, f".from-hf-m-0b.partial-{os.getpid()}"))  # a live one
    os.makedirs(os.path.join(disk, "iter_0000007"))  # complete, untracked: kept
    saving = ["--save-interval", "1", "--eval-iters", "0"]
    cases = [
        {"cli": _args(prefix, 2) + ["--save", disk, *saving], "fault": ("disk", 1, 2)},
        {"cli": _args(prefix, 1) + ["--save", perm, *saving], "fault": ("permission", 0, 1)},
        {"cli": _args(prefix, 3) + ["--load", rng], "break_rng": (disk, 1)},
    ]
    per_rank = run_distributed(checkpoint_ranks.run_cases, 2, argv=cases[0]["cli"],
                               cases=cases, timeout=150)  # fmt: skip
    runs = [*zip(*per_rank, strict=True), None, None, None]  # None: not run
    return {"prefix": prefix, "disk": disk, "perm": perm, "rng": rng, "runs": runs}


def _one_line(results: tuple[dict, dict] | None) -> str:
    """Every rank exited with 1; rank 0 said one line, the others nothing."""
    assert results is not None, "not run: an earlier case did not fail"
    assert [r["code"] for r in results] == [1, 1], results
    err = results[0]["stderr"].strip()
    assert len(err.splitlines()) == 1 and err.startswith("anyspeed pretrain: error: "), err
    assert "error" not in results[1]["stderr"], results[1]["stderr"]
    return err


def test_disk_full_during_save_keeps_last_good_checkpoint(faults):
    """Rank 1 cannot write its data: both ranks stop, naming the cause and the last good one."""
    save = faults["disk"]
    err = _one_line(faults["runs"][0])
    assert f"could not save checkpoint to {save}: [Errno 27] File too large" in err
    assert err.endswith(f"; last good checkpoint: {save}/{ITER}")
    assert open(os.path.join(save, TRACKER)).read() == "1"
    assert not os.path.exists(os.path.join(save, "iter_0000002.tmp"))


def test_stale_leftovers_are_removed_at_start(faults):
    """Half-written saves and dead conversions go; checkpoints and a live process's stay."""
    assert sorted(os.listdir(faults["disk"])) == sorted(
        [f".from-hf-m-0b.partial-{os.getpid()}", "iter_0000007", ITER, TRACKER, LOCK]
    )


def test_unwritable_save_dir_leaves_nothing(faults):
    """The first save cannot stage its directory: both ranks stop, nothing half-written."""
    save = faults["perm"]
    err = _one_line(faults["runs"][1])
    assert f"could not save checkpoint to {save}: [Errno 13] Permission denied" in err
    assert err.endswith("; last good checkpoint: none yet")
    assert os.listdir(save) in ([], [LOCK])  # the run's lock file is no checkpoint data


def test_rng_state_one_rank_cannot_restore(faults):
    """Only rank 1's restore fails, while loading: rank 0 names the file, both exit."""
    err = _one_line(faults["runs"][2])
    rng = os.path.join(faults["rng"], ITER, "anyspeed_rng", "pp0_tp0_cp0_dp1.pt")
    assert f"--load {faults['rng']!r}: {rng}: not a usable RNG state" in err


# ------------------------------------------------------------------ before any process group
@pytest.fixture
def copy(faults, tmp_path):
    """A copy of the disk run's good checkpoint (iteration 1, two ranks) and its iter dir."""
    dst = str(tmp_path / "ck")
    shutil.copytree(faults["disk"], dst, ignore=shutil.ignore_patterns(".from-hf*", "iter_0000007"))
    return dst, os.path.join(dst, ITER)


def _refused(capsys, faults, ck: str, *extra: str) -> str:
    """``main`` stops before any process group: exit 2, one line naming --load."""
    assert main(_args(faults["prefix"], 3) + ["--load", ck, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"anyspeed pretrain: error: --load {ck!r}: "), err
    return err


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)


def test_tracker_names_a_missing_iteration(capsys, faults, copy):
    ck, _ = copy
    open(os.path.join(ck, TRACKER), "w").write("5")
    err = _refused(capsys, faults, ck)
    assert f"names 5 but {ck}/iter_0000005 does not exist" in err


@pytest.mark.parametrize("size", [0, 1000])
def test_truncated_or_empty_data_file(capsys, faults, copy, size):
    _, it = copy
    name = sorted(n for n in os.listdir(it) if n.endswith(".distcp"))[-1]
    want = os.path.getsize(os.path.join(it, name))
    _truncate(os.path.join(it, name), size)
    err = _refused(capsys, faults, copy[0])
    assert f"{it}/{name} is truncated: {size} bytes" in err
    assert f"records data up to byte {want}" in err


def test_missing_data_file(capsys, faults, copy):
    _, it = copy
    os.remove(os.path.join(it, "__0_1.distcp"))
    assert f"{it}/__0_1.distcp is missing" in _refused(capsys, faults, copy[0])


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated"])
def test_broken_metadata(capsys, faults, copy, damage):
    _, it = copy
    path = os.path.join(it, ".metadata")
    if damage == "missing":
        os.remove(path)
    else:
        _truncate(path, 0 if damage == "empty" else 300)
    err = _refused(capsys, faults, copy[0])
    assert it in err and ("no .metadata" if damage == "missing" else "metadata") in err


def test_metadata_pointing_outside_the_checkpoint(capsys, faults, copy):
    """A hostile .metadata naming ``../`` paths is refused before anything is read there."""
    from anyspeed.convert.dcp_io import DcpReader

    _, it = copy
    meta = DcpReader(it).meta
    info = next(iter(meta.storage_data.values()))
    info.relative_path = "../../outside.distcp"
    with open(os.path.join(it, ".metadata"), "wb") as fh:
        pickle.dump(meta, fh)
    assert "points outside the checkpoint ('../../outside.distcp')" in _refused(
        capsys, faults, copy[0]
    )


def test_data_file_linked_outside_the_checkpoint(capsys, faults, copy, tmp_path):
    _, it = copy
    name = sorted(n for n in os.listdir(it) if n.endswith(".distcp"))[0]
    os.replace(os.path.join(it, name), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(it, name))
    err = _refused(capsys, faults, copy[0])
    assert f"{it}/{name} is a link leading outside the checkpoint" in err


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_broken_common_state(capsys, faults, copy, damage):
    _, it = copy
    path = os.path.join(it, "common.pt")
    os.remove(path) if damage == "missing" else _truncate(path, 100)
    err = _refused(capsys, faults, copy[0])
    assert f"{path}" in err and ("is missing" if damage == "missing" else "common.pt:") in err


def test_unreadable_rng_state(capsys, monkeypatch, faults, copy):
    """Read before start by the launcher (or a lone process), which has no RANK yet."""
    monkeypatch.delenv("RANK", raising=False)
    _, it = copy
    path = os.path.join(it, "anyspeed_rng", "pp0_tp0_cp0_dp1.pt")
    _truncate(path, 100)
    assert f"{path}: " in _refused(capsys, faults, copy[0])
    # --no-load-rng does not read it: the check passes and the run would launch, so only the
    # check is called here.
    from anyspeed.checkpoint.checks import check_load
    from anyspeed.layout import Layout

    check_load(copy[0], Layout(), 2, load_rng=False)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ffn-hidden-size", "128"], "checkpoint has --ffn-hidden-size 176, this run has 128"),
        (["--num-layers", "3"], "the checkpoint has --num-layers 2, this run has 3"),
        (["--hidden-size", "128"], "the checkpoint has --hidden-size 64, this run has 128"),
        (["--padded-vocab-size", "1024"], "--padded-vocab-size 512, this run has 1024"),
        (["--num-query-groups", "1"], "the checkpoint has --num-query-groups 2, this run has 1"),
        (["--disable-bias-linear"], None),
        (["--untie-embeddings-and-output-weights"],
         "saved without --untie-embeddings-and-output-weights, this run is with it"),
    ],
)  # fmt: skip
def test_checkpoint_of_another_architecture(capsys, faults, flags, says):
    """Megatron's "Global shape mismatch" traceback becomes one line naming the flag."""
    ck = faults["disk"]
    argv = _args(faults["prefix"], 3) + ["--load", ck, *flags]
    if says is None:  # tiny-qwen2.5 already has no linear biases: the flag changes nothing
        from anyspeed.stages.prepare import prepare

        prepare(argv, "launcher")
        return
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{ck}/{ITER} holds another architecture" in err, err
    assert says in err, err


def test_record_broken_inside_a_whole_file_is_named(faults, copy):
    """Damage that only shows while loading (sizes intact) is named by record and file."""
    from anyspeed.checkpoint import checks as checkpoint_checks
    from anyspeed.convert.dcp_io import DcpReader

    _, it = copy
    reader = DcpReader(it)
    index, info = next((i, s) for i, s in reader.storage.items()
                       if hasattr(reader.tensors[i.fqn], "size"))  # fmt: skip
    with open(os.path.join(it, info.relative_path), "r+b") as fh:
        fh.seek(info.offset)
        fh.write(b"\0" * 64)
    checkpoint_checks.verify(it)  # the files are whole: the pre-start check cannot see it
    text = checkpoint_checks.describe_failure(it, RuntimeError("from the load"))
    assert text.startswith(f"{os.path.join(it, info.relative_path)} ({index.fqn}): "), text


def test_unwritable_save_dir_before_start(capsys, faults, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(_args(faults["prefix"], 3) + ["--save", str(blocker / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"anyspeed pretrain: error: --save {str(blocker / 'ck')!r}: directory is not writable"
    )
    if os.geteuid() != 0:  # modes do not stop root
        tmp_path.joinpath("ro").mkdir(mode=0o555)
        assert main(_args(faults["prefix"], 3) + ["--save", str(tmp_path / "ro")]) == 2
