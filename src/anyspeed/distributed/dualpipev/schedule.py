"""DualPipeV as a drop-in for Megatron's ``forward_backward_func``.

The same call as Megatron-Core's schedules (keywords, per-micro-batch loss dicts returned on
the stage holding the loss), over two model chunks per rank placed in a V
(:mod:`anyspeed.distributed.dualpipev.plan`). Each forward and backward is Megatron's own
``forward_step`` / ``backward_step``, so loss scaling, MoE auxiliary-loss scaling and
per-token loss work as in its 1F1B; only the order and the messages differ. Sends do not
block; a receive waits where its tensor is needed; each message kind has its own group
(:mod:`anyspeed.distributed.dualpipev.channels`). The loss is on pipeline rank 0 (chunk 1),
next to the embedding, so tied embedding and output weights share their gradient locally.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from anyspeed.distributed.dualpipev import plan, weight_grads
from anyspeed.distributed.dualpipev.channels import Link, links, weight_split


class _Mail:
    """Sends and receives over the four links; sends stay pending until :meth:`drain`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        from megatron.core import parallel_state as ps

        self.shape, self.dtype, self.device = shape, dtype, device
        self.links = links()
        self.prev = ps.get_pipeline_model_parallel_prev_rank()
        self.next = ps.get_pipeline_model_parallel_next_rank()
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, link: Link, tensor: torch.Tensor) -> None:
        peer = self.next if link in (Link.DOWN, Link.GRAD_DOWN) else self.prev
        data = tensor.detach().contiguous()
        work = dist.isend(data, peer, group=self.links[link], tag=int(link))
        self.pending.append((work, data))
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def recv(self, link: Link, grad: bool) -> torch.Tensor:
        peer = self.prev if link in (Link.DOWN, Link.GRAD_DOWN) else self.next
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buf, peer, group=self.links[link], tag=int(link)).wait()
        return buf.requires_grad_(grad)

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class _Step:
    """One call of the schedule on this rank: the chunks, their saved tensors, the mail."""

    def __init__(self, kw: dict[str, Any], model: list[Any], data: list[Iterator]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel.schedules import get_tensor_shapes
        from megatron.core.utils import get_model_config, get_model_type

        self.kw, self.model, self.data = kw, model, data
        self.config = get_model_config(model[0])
        self.model_type = get_model_type(model[0])
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.rank = ps.get_pipeline_model_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        (shape,) = get_tensor_shapes(
            seq_length=kw["seq_length"],
            micro_batch_size=kw["micro_batch_size"],
            decoder_seq_length=kw.get("decoder_seq_length"),
            config=self.config,
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
        )
        device = next(model[0].parameters()).device
        self.mail = _Mail(tuple(shape), self.config.pipeline_dtype, device)
        self.saved: list[deque] = [deque(), deque()]
        # The last rank (the V's tip): chunk 0's outputs to chunk 1, chunk 1's input grads back.
        self.tip_outputs: deque = deque()
        self.tip_grads: deque = deque()
        self.store: list[Any] = []
        self.tokens = torch.zeros([], dtype=torch.int, device=device)

    @property
    def last(self) -> bool:
        return self.rank == self.pp - 1

    def forward(self, op: plan.Op) -> None:
        from megatron.core.pipeline_parallel.schedules import (
            check_first_val_step,
            deallocate_output_tensor,
            forward_step,
        )

        c, kw = op.chunk, self.kw
        grad = not kw["forward_only"]
        if c == 0:
            x = self.mail.recv(Link.DOWN, grad) if self.rank > 0 else None
        else:
            x = self.tip_outputs.popleft() if self.last else self.mail.recv(Link.UP, grad)
        out, tokens = forward_step(
            kw["forward_step_func"],
            self.data[c],
            self.model[c],
            kw["num_microbatches"],
            x,
            self.store,
            self.config,
            self.cp_size,
            collect_non_loss_data=kw["collect_non_loss_data"],
            is_first_microbatch=check_first_val_step(
                kw["first_val_step"], kw["forward_only"], op.microbatch == 0
            ),
            current_microbatch=op.microbatch,
            vp_stage=c,
            is_last_stage=c == 1 and self.rank == 0,
        )
        self.tokens += tokens
        if c == 0 and self.last:
            self.tip_outputs.append(out.detach().requires_grad_(grad))
        elif c == 0:
            self.mail.send(Link.DOWN, out)
        elif self.rank > 0:
            self.mail.send(Link.UP, out)
        if grad:
            self.saved[c].append((x, out))
            deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)

    def backward(self, op: plan.Op) -> None:
        from megatron.core.pipeline_parallel.schedules import backward_step

        c = op.chunk
        x, out = self.saved[c].popleft()
        if c == 1:
            dy = self.mail.recv(Link.GRAD_DOWN, False) if self.rank > 0 else None
        else:
            dy = self.tip_grads.popleft() if self.last else self.mail.recv(Link.GRAD_UP, False)
        dx = backward_step(x, out, dy, self.model_type, self.config)
        if c == 1 and self.last:
            self.tip_grads.append(dx)
        elif c == 1:
            self.mail.send(Link.GRAD_DOWN, dx)
        elif self.rank > 0:
            self.mail.send(Link.GRAD_UP, dx)

    def finish(self) -> None:
        """Wait for the sends; then the gradients' reductions, with the loss's token count
        (on rank 0 here) where Megatron looks for it (the last pipeline rank)."""
        from megatron.core import parallel_state as ps

        self.mail.drain()
        if self.kw["forward_only"] or self.config.finalize_model_grads_func is None:
            return
        tokens = None
        if self.config.calculate_per_token_loss:
            tokens = self.tokens
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast(tokens, src=ps.get_pipeline_model_parallel_first_rank(), group=group)
        self.config.finalize_model_grads_func(
            self.model, tokens, force_all_reduce=self.kw["force_all_reduce"]
        )
        _share_tied_gradient(self.model)


def forward_backward_dualpipev(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Any = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool = False,
) -> list[Any]:
    """One step of DualPipeV over this rank's two chunks (``model``, ``data_iterator``: one
    per chunk); the loss dicts (or collected outputs) on pipeline rank 0, else ``[]``."""
    if adjust_tensor_shapes_fn is not None or p2p_communicator is not None:
        raise ValueError("DualPipeV sends one tensor shape over its own links")
    if pg_collection is not None:
        raise ValueError("DualPipeV runs on Megatron's global parallel state")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    data = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    if len(chunks) != 2 or len(data) != 2:
        raise ValueError("DualPipeV needs two model chunks and two data iterators on each rank")
    step = _Step(
        dict(
            forward_step_func=forward_step_func,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
            force_all_reduce=force_all_reduce,
        ),
        chunks,
        data,
    )
    split = weight_split() and not forward_only
    ops = (
        plan.forward_plan(step.pp, step.rank, num_microbatches)
        if forward_only
        else plan.training_plan(step.pp, step.rank, num_microbatches, split)
    )
    with weight_grads.split_step() if split else contextlib.nullcontext():
        for op in ops:
            if op.kind == "F":
                step.forward(op)
            elif op.kind == "B":
                step.backward(op)
            elif op.kind == "I":
                with weight_grads.deferred():
                    step.backward(op)
            else:
                weight_grads.run_weight_unit()
    step.finish()
    return step.store if step.rank == 0 else []


def _share_tied_gradient(model: list[Any]) -> None:
    """Tied embedding and output weights on rank 0 (chunk 0's embedding, chunk 1's output
    layer, or the MTP block's embedding there; the same values): each gets the sum of both
    gradients, as Megatron's embedding all-reduce gives the first and last stage."""
    from megatron.core.utils import get_attr_wrapped_model

    first = get_attr_wrapped_model(model[0], "pre_process", return_model_obj=True)
    last = get_attr_wrapped_model(model[1], "post_process", return_model_obj=True)
    shared = last.share_embeddings_and_output_weights or getattr(last, "mtp_process", False)
    if not (first.pre_process and last.post_process and shared):
        return
    a = first.shared_embedding_or_output_weight()
    b = last.shared_embedding_or_output_weight()
    attr = "main_grad" if hasattr(a, "main_grad") else "grad"
    ga, gb = getattr(a, attr), getattr(b, attr)
    if ga is None or gb is None:  # frozen embeddings
        return
    total = ga + gb
    ga.copy_(total)
    gb.copy_(total)
