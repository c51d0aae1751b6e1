"""Checkpoints of ``anyspeed fsdp2``: the sharded model and optimizer through
``torch.distributed.checkpoint`` (each rank writes its shards; any number of ranks reads them
back), the data position and schedule beside them, and the export to a plain transformers
directory.

A checkpoint is written into ``output_dir/.tmp_step_N`` and renamed to ``step_N`` only when
every rank has finished, then ``latest`` names it: a run killed while saving leaves the last
good checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from anyspeed.errors import UsageError

LATEST = "latest"
STATE = "train_state.json"


def step_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"step_{step}")


def save(output_dir: str, step: int, trainer: Any, scheduler: Any, consumed: int) -> str:
    """Write checkpoint ``step`` of ``trainer``'s model and optimizer; its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = step_dir(output_dir, step)
    tmp = os.path.join(output_dir, f".tmp_step_{step}")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        state = {
            "step": step,
            "consumed_samples": consumed,
            "scheduler": scheduler.state_dict(),
            "world_size": dist.get_world_size(),
        }
        with open(os.path.join(tmp, STATE), "w") as f:
            json.dump(state, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(output_dir, LATEST + ".tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(output_dir, LATEST + ".tmp"), os.path.join(output_dir, LATEST))
    dist.barrier()
    return final


def resolve(resume: str, output_dir: str) -> str | None:
    """The checkpoint directory ``resume`` names ("auto": ``output_dir``'s latest, None when
    it has none); UsageError (one line) when it is not a checkpoint of this trainer."""
    if not resume:
        return None
    if resume == "auto":
        tracker = os.path.join(output_dir, LATEST)
        if not os.path.isfile(tracker):
            return None
        with open(tracker) as f:
            resume = os.path.join(output_dir, f.read().strip())
    if not os.path.isfile(os.path.join(resume, STATE)) or not os.path.isfile(
        os.path.join(resume, ".metadata")
    ):
        raise UsageError(
            f"training.resume_from_checkpoint {resume!r} is not an anyspeed fsdp2 checkpoint "
            f"(it needs {STATE} and .metadata)"
        )
    return resume


def load(path: str, trainer: Any, scheduler: Any) -> dict[str, Any]:
    """Read checkpoint ``path`` into the (sharded) model and optimizer, at any number of
    ranks; the saved training state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    with open(os.path.join(path, STATE)) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved["scheduler"])
    trainer.iteration = int(saved["step"])
    return saved


# Files of a model directory that are not weights: copied into the export as they are.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")


def export_hf(model: torch.nn.Module, source_dir: str, out_dir: str) -> None:
    """Gather the full weights and write a transformers directory at ``out_dir`` (rank 0):
    the model's config and safetensors, and the source directory's tokenizer and processor
    files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name in sorted(os.listdir(source_dir)):
            path = os.path.join(source_dir, name)
            if os.path.isfile(path) and not name.endswith(_WEIGHTS) and name != "config.json":
                shutil.copy2(path, os.path.join(tmp, name))
        from anyspeed.fsdp.model import quiet

        with quiet():
            model.save_pretrained(tmp, state_dict=full)
        _keep_architecture(source_dir, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier()


def _keep_architecture(source_dir: str, out_dir: str) -> None:
    """The source's ``architectures`` in the export's config.json (save_pretrained writes the
    class FSDP2 made of the model's, which transformers does not know)."""
    with open(os.path.join(source_dir, "config.json")) as f:
        arch = json.load(f).get("architectures")
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["architectures"] = arch
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
