"""The partial rollout in a run (:mod:`.partial` holds its buffer): each round's answers split
over the data-parallel replicas and gathered back, the rollout's groups handed to the policy
task, and the buffer kept in every checkpoint so that a resumed run continues it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from anyspeed.stages.common.rl.batches import Rollout
from anyspeed.stages.common.rl.partial import FILE, Buffer, Continue, Flight
from anyspeed.training.hooks import Hook

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


class PartialRollouts:
    """The run's buffer, the snapshots a checkpoint keeps (the buffer before and after the
    latest rollout, by rollout index) and those a resumed run starts from."""

    def __init__(self, cfg: Any, eos: tuple[int, ...]) -> None:
        self.cfg = cfg
        self.buffer = Buffer(cfg.partial, cfg.group, cfg.rollout_batch, eos)
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.restored: dict[int, dict[str, Any]] | None = None
        self.last: Any = None  # the latest rollout's partial.Drawn (every replica's groups)

    def resume(self, lora_cfg: Any, run: Run) -> None:
        """Read the buffer of the checkpoint the run resumes from (none: a new start)."""
        from anyspeed.distributed.process import print0
        from anyspeed.stages.common.lora_start import resumed_dir

        at = resumed_dir(lora_cfg, run)
        if at is None:
            return
        path = os.path.join(at, FILE)
        if not os.path.isfile(path):
            print0(f" {at} holds no partial-rollout buffer: its answers in flight start afresh")
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        self.restored = {int(k): v for k, v in saved["snapshots"].items()}

    def drawer(
        self, task: Any, trainer: Trainer, data: Any, order: Any, at: int, args: Any
    ) -> Callable[[], tuple[Rollout, list[float]]]:
        """Rollout ``at``'s draw for :meth:`~.task.PolicyTask.rolled`: this replica's share of
        the groups, rewarded, and the draw's statistics."""

        def draw() -> tuple[Rollout, list[float]]:
            from megatron.core import parallel_state as ps

            if self.restored is not None:
                if at in self.restored:
                    self.buffer.load(self.restored[at])
                self.restored = None
            self.snapshots = {at: self.buffer.state()}
            c = self.cfg
            rb = c.rollout_batch

            def prompts(batch: int) -> list[tuple[int, int]]:
                return [(int(order[k]), k) for k in range(batch * rb, (batch + 1) * rb)]

            cont = _continuer(task, trainer, data, args)
            drawn = self.last = self.buffer.draw(at, prompts, cont, c.max_response)
            self.snapshots[at + 1] = self.buffer.state()
            dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            per = rb // dp
            mine = drawn.flights[rank * per : (rank + 1) * per]
            rows = [f.row for f in mine]
            rep = [_prompt(data, f.row) for f in mine for _ in range(c.group)]
            tokens = [a.tokens for f in mine for a in f.answers]
            lps = [a.logps for f in mine for a in f.answers]
            roll = task.scored(trainer, data, rows, rep, (tokens, lps, None, tokens), args)
            return roll, drawn.stats()

        return draw

    def saver(self) -> Hook:
        return _SaveBuffer(self)

    def write(self, directory: str) -> None:
        """The snapshots into a checkpoint being written (global rank 0: every rank holds
        the same buffer)."""
        from anyspeed.distributed.process import is_rank0

        if not is_rank0():
            return
        doc = {"split": self.cfg.partial.split, "snapshots": self.snapshots}
        with open(os.path.join(directory, FILE), "w", encoding="utf-8") as f:
            json.dump(doc, f)


class _SaveBuffer(Hook):
    """Writes the buffer into each checkpoint before it is renamed into place."""

    def __init__(self, owner: PartialRollouts) -> None:
        self.owner = owner

    def on_checkpoint_written(self, state: LoopState, tmp_dir: str) -> None:
        self.owner.write(tmp_dir)


def _prompt(data: Any, row: int) -> list[int]:
    return [int(t) for t in data.input_ids[row]]


def _continuer(task: Any, trainer: Trainer, data: Any, args: Any) -> Continue:
    """A round's sampling: the answers split in contiguous shares over the data-parallel
    replicas, each continued from its prompt and tokens so far with its own seed (the
    sample's round), and every replica's results gathered back in order. Replicas that
    decode in lockstep (experts across them) pad their shares to one row count."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from anyspeed.stages.common.rl.sampling import row_seed

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sampler = task.sampler(trainer)

    def cont(items: list[tuple[Flight, int]], budget: int) -> list[tuple[list[int], list[float]]]:
        n = len(items)
        mine = items[n * rank // dp : n * (rank + 1) // dp]
        prompts = [_prompt(data, f.row) + f.answers[i].tokens for f, i in mine]
        seeds = tuple(row_seed(args.seed, f.answers[i].rounds, f.key, i) for f, i in mine)
        req = task.request(budget, seeds, args)
        got: tuple[list[list[int]], list[list[float]]] = ([], [])
        if req.lockstep:  # every rank runs the same forwards: as many rows, extra ones dropped
            f, i = items[0]
            extra = -(-n // dp) - len(mine)
            prompts += [_prompt(data, f.row) + f.answers[i].tokens] * extra
            req = task.request(budget, seeds + (0,) * extra, args)
        if prompts:
            toks, lps = sampler(prompts, req)
            got = (toks[: len(mine)], lps[: len(mine)])
        if dp == 1:
            return list(zip(*got, strict=True))
        shares: list[Any] = [None] * dp
        dist.all_gather_object(shares, got, group=ps.get_data_parallel_group())
        return [pair for toks, lps in shares for pair in zip(toks, lps, strict=True)]

    return cont
