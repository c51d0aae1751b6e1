"""Per-step MoE statistics: the routers' auxiliary losses and how many tokens each expert got.

Megatron keeps the aux and z losses per layer in its tracker (summed over micro-batches) and its
``track_moe_metrics`` writes them with a literal ``device="cuda"``; tokens per expert it does not
report at all. :class:`MoEMetrics` counts each router's routing decisions with a forward hook,
sums them over the job (every token counted once, whatever the layout), and reads Megatron's
tracker the way Megatron-LM's own logging does.
"""

from __future__ import annotations

from typing import Any

import torch

from anyspeed.layout import Layout


class MoEMetrics:
    """Counts tokens routed to each expert of each MoE layer during one optimizer step."""

    def __init__(
        self, model: list[torch.nn.Module], layout: Layout, num_layers: int, num_experts: int
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from anyspeed.device import torch_device

        self.layout = layout
        self.num_layers, self.num_experts = num_layers, num_experts  # the same on every rank
        self.device = torch_device()  # NCCL reduces device tensors only
        self.counts: dict[int, torch.Tensor] = {}
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router: Any, inputs: Any, outputs: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation and recomputation do not route training tokens
        _, routing_map = outputs
        got = routing_map.detach().sum(0, dtype=torch.float64)  # stays on the device: no sync
        layer = int(router.layer_number)
        self.counts[layer] = self.counts.get(layer, 0) + got

    def reset(self) -> None:
        """Forget the counts and Megatron's tracked losses (call before a step)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.clear()
        clear_aux_losses_tracker()

    def collect(self, num_microbatches: int) -> dict[str, Any]:
        """The step's job-wide figures (a collective: every rank calls it): tokens per expert
        per MoE layer, the max/mean load, and each tracked loss averaged over MoE layers."""
        table = torch.zeros(
            self.num_layers, self.num_experts, dtype=torch.float64, device=self.device
        )
        for layer, got in self.counts.items():
            table[layer - 1] += got.to(self.device)
        table = self._sum(table)
        # Tensor-parallel ranks without sequence parallelism route the same tokens.
        dup = 1 if self.layout.sequence_parallel else self.layout.tp
        table /= dup
        layers = [i for i in range(self.num_layers) if table[i].sum() > 0]
        tokens = {i + 1: [int(round(x)) for x in table[i].tolist()] for i in layers}
        per_layer = {i: max(v) / (sum(v) / len(v)) for i, v in tokens.items() if sum(v)}
        out: dict[str, Any] = {
            "tokens_per_expert": tokens,
            "load_per_layer": per_layer,  # max over mean tokens per expert
            "load_max_over_mean": max(per_layer.values()) if per_layer else float("nan"),
        }
        out.update(self._losses(num_microbatches))
        return out

    def _sum(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """All-reduce a host tensor through the device (SUM unless ``op``); back on the host."""
        on_device = t.to(self.device)
        torch.distributed.all_reduce(on_device, op=op or torch.distributed.ReduceOp.SUM)
        return on_device.cpu()

    def _losses(self, num_microbatches: int) -> dict[str, float]:
        """Each loss in Megatron's tracker as Megatron-LM logs it: summed over the group whose
        ranks each hold a share (the router's reduce group), averaged over the other ranks
        that hold the layer, then over MoE layers, per micro-batch. Collective-safe when
        pipeline stages hold different layers."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        mine = sorted(n for n, e in tracker.items() if e["values"].abs().sum() > 0)
        everyone: list[list[str]] = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(everyone, mine)
        held = torch.zeros(self.num_layers, dtype=torch.float64)
        for layer in self.counts:
            held[layer - 1] = 1.0
        held = self._sum(held)
        out = {}
        for name in sorted(set().union(*everyone)):
            # [values..., size of the group that shares one loss between its ranks]
            values = torch.zeros(self.num_layers + 1, dtype=torch.float64)
            if name in tracker:
                values[:-1] += tracker[name]["values"].to("cpu", torch.float64)
                group = tracker[name].get("reduce_group")
                values[-1] = group.size() if group is not None else 1
            shared = self._sum(values[-1:].clone(), torch.distributed.ReduceOp.MAX)
            values = self._sum(values)
            layers = held > 0
            per_layer = values[:-1][layers] * shared / held[layers] / num_microbatches
            out[name] = float(per_layer.mean()) if layers.any() else float("nan")
        return out


def log_fields(moe: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The iteration line's MoE part and its scalars (aux/z losses, worst expert load)."""
    names = {
        "load_balancing_loss": "aux loss",
        "seq_load_balancing_loss": "seq aux loss",
        "global_load_balancing_loss": "global aux loss",
        "z_loss": "z loss",
    }
    scalars = {k: float(moe[k]) for k in names if k in moe}
    scalars["expert_load_max_over_mean"] = float(moe["load_max_over_mean"])
    text = "".join(f"{names[k]}: {v:.4E} | " for k, v in scalars.items() if k in names)
    return text + f"expert load max/mean: {moe['load_max_over_mean']:.2f} | ", scalars
