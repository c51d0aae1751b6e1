"""The one parallel layout: sizes, the CP algorithm, one derivation from flags, one validation.

The adaptor's layout check, the Megatron-LM hooks, ``anyspeed pretrain`` and the training step
all use :class:`Layout`. Each problem is one ValueError line naming the flag and what would fix
it, raised before any process group exists (a bad layout otherwise surfaces as a hang or a deep
assertion). The data-parallel size is what the world leaves over: ``layout.dp(world_size)``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from anyspeed.layout import checks as layout_checks
from anyspeed.layout.placement import check_noop_layers, parse_noop_layers, split, without_noop


class CPAlgo(str, Enum):
    """Context-parallel algorithm. The value is Megatron's ``cp_comm_type``; ``flag`` is the
    MindSpeed ``--context-parallel-algo`` name users write."""

    RING = "p2p"
    ULYSSES = "a2a"
    HYBRID = "a2a+p2p"

    @property
    def flag(self) -> str:
        return _FLAG_OF[self]

    @classmethod
    def parse(cls, name: str | CPAlgo | None) -> CPAlgo:
        """The algorithm for a MindSpeed flag value or a ``cp_comm_type``; ValueError (one line)
        listing the choices otherwise."""
        if isinstance(name, CPAlgo):
            return name
        if name is None:
            return cls.RING
        for algo in cls:
            if name in (algo.value, algo.flag):
                return algo
        raise ValueError(
            f"--context-parallel-algo {name}: choose megatron_cp_algo (ring), ulysses_cp_algo "
            "or hybrid_cp_algo"
        )


_FLAG_OF = {
    CPAlgo.RING: "megatron_cp_algo",
    CPAlgo.ULYSSES: "ulysses_cp_algo",
    CPAlgo.HYBRID: "hybrid_cp_algo",
}


@dataclass
class Layout:
    """How the ranks split one model: tensor, pipeline (+ virtual), context and data parallel."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_algo: CPAlgo = CPAlgo.RING
    ulysses_degree: int | None = None  # hybrid CP: ranks per Ulysses group
    vpp: int | None = None  # model chunks per pipeline stage (interleaved schedule)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    torch_fsdp2: bool = False  # --use-torch-fsdp2: FSDP2 over the data-parallel ranks, not DDP
    fsdp2_reshard_after_forward: bool = True
    megatron_fsdp: bool = False  # --use-megatron-fsdp (its optimizer is the distributed one)
    fsdp_sharding: str = "optim_grads_params"  # --data-parallel-sharding-strategy
    # Gradient bucket size in elements (--ddp-bucket-size); None: Megatron's default.
    bucket_size: int | None = None
    ep: int = 1  # expert parallel: ranks that split the experts of a MoE layer
    etp: int | None = None  # expert tensor parallel (None: the same as tp)
    # Uneven pipeline stages: layers of the first / last stage (None: an even share).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # --schedules-method dualpipev: two chunks per rank in a V (rank r: stages r and 2PP-1-r)
    dualpipev: bool = False
    dualpipev_dw_detach: bool = False  # weight gradients where the V would idle (zero bubble)
    # --noop-layers: empty layer slots (0-based, counted in --num-layers) that move the stage
    # boundaries; the real layers keep their numbers (anyspeed.layout.placement)
    noop_layers: tuple[int, ...] = ()
    # --num-layer-list whose middle stages differ: each pipeline stage's real layers, placed
    # by anyspeed (Megatron-Core sizes only the first and last stage itself)
    layer_list: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.cp_algo = CPAlgo.parse(self.cp_algo)
        if self.vpp is not None and self.vpp <= 1:
            self.vpp = None
        if self.dualpipev:
            if self.vpp not in (None, 2):
                raise ValueError(
                    "--schedules-method dualpipev places two chunks on each rank itself: "
                    "remove --num-layers-per-virtual-pipeline-stage"
                )
            self.vpp = 2
        self.noop_layers = tuple(sorted(self.noop_layers))

    def stage_of(self, pp_rank: int, chunk: int) -> int:
        """The pipeline stage (0 holds the embedding) of chunk ``chunk`` on ``pp_rank``."""
        if self.dualpipev and chunk == 1:
            return 2 * self.pp - 1 - pp_rank
        return chunk * self.pp + pp_rank

    @property
    def schedule(self) -> str:
        """The pipeline schedule for start-up lines: ``VPP=<chunks>`` or ``DualPipeV``."""
        return "DualPipeV" if self.dualpipev else f"VPP={self.chunks}"

    @property
    def output_pp_rank(self) -> int:
        """The pipeline rank holding the loss and logits (rank 0 under DualPipeV)."""
        return 0 if self.dualpipev else self.pp - 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model (TP x PP x CP)."""
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel ranks inside one expert."""
        return self.tp if self.etp is None else self.etp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline stage (1 without virtual pipelining)."""
        return self.vpp or 1

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def for_other_model(self) -> Layout:
        """This layout for a model of another depth (a teacher, a reward model): the noop
        slots belong to the trained model's layers."""
        return dataclasses.replace(self, noop_layers=(), layer_list=())

    @property
    def places_layers(self) -> bool:
        """Whether anyspeed places the chunks' layers (the ``chunk-placement`` patch: a V or
        noop slots, a --num-layer-list of unequal middle stages) rather than Megatron's own
        arithmetic."""
        return self.dualpipev or bool(self.noop_layers) or bool(self.layer_list)

    def slot_layers(self, num_layers: int) -> list[int]:
        """Layer slots (real and noop) of each stage, in stage order (stage 0 holds the
        embedding; ``pp x chunks`` stages, ``2 x PP`` under DualPipeV): the first and last as
        given (uneven stages), the others an even share; ValueError (one line) otherwise."""
        pp, first, last = self.pp, self.first_stage_layers, self.last_stage_layers
        slots = num_layers + len(self.noop_layers)
        check_noop_layers(self.noop_layers, num_layers)
        if self.layer_list:
            return self._listed(slots)
        if self.dualpipev:
            if not self.uneven and slots % (2 * pp):
                raise ValueError(
                    f"--num-layers {slots} is not divisible by 2 x "
                    f"--pipeline-model-parallel-size {pp} = {2 * pp} (--schedules-method "
                    "dualpipev gives each rank two equal chunks; or set the first and last "
                    "stage's with --decoder-first/last-pipeline-num-layers, or pad with "
                    "--noop-layers)"
                )
            flags = "--decoder-first/last-pipeline-num-layers under --schedules-method dualpipev"
            return split(slots, 2 * pp, first, last, flags)
        if not self.uneven:
            if slots % (pp * self.chunks):
                raise ValueError(
                    f"--num-layers {slots} is not divisible by pipeline stages x virtual "
                    f"chunks = {pp * self.chunks} (uneven stages: "
                    "--decoder-first/last-pipeline-num-layers or --num-layer-list; or pad "
                    "with --noop-layers)"
                )
            return [slots // (pp * self.chunks)] * (pp * self.chunks)
        flags = "--decoder-first/last-pipeline-num-layers (or --num-layer-list)"
        if pp < 2 or self.vpp:
            raise ValueError(f"{flags} need --pipeline-model-parallel-size >= 2 and no VPP")
        return split(slots, pp, first, last, flags)

    def _listed(self, num_layers: int) -> list[int]:
        """``--num-layer-list``'s stages, checked against the layout (one line otherwise)."""
        text = ",".join(map(str, self.layer_list))
        if self.dualpipev or self.vpp or self.noop_layers or self.uneven:
            raise ValueError(
                f"--num-layer-list {text} places each pipeline stage's layers: use it without "
                "VPP, --schedules-method dualpipev, --noop-layers and "
                "--decoder-first/last-pipeline-num-layers"
            )
        if len(self.layer_list) != self.pp or sum(self.layer_list) != num_layers:
            raise ValueError(
                f"--num-layer-list {text} needs one entry per pipeline stage ({self.pp}) "
                f"adding up to --num-layers {num_layers}"
            )
        return list(self.layer_list)

    def virtual_stage_layers(self, num_layers: int) -> list[int]:
        """Real decoder layers of each stage, in stage order (:meth:`slot_layers` without the
        noop slots); ``num_layers`` counts real layers only."""
        return without_noop(self.slot_layers(num_layers), self.noop_layers)

    def chunk_layers(self, num_layers: int, pp_rank: int) -> list[range]:
        """The decoder layers (global 0-based numbers) of each model chunk of ``pp_rank``."""
        per_stage = self.virtual_stage_layers(num_layers)
        stages = [self.stage_of(pp_rank, chunk) for chunk in range(self.chunks)]
        return [range(sum(per_stage[:s]), sum(per_stage[: s + 1])) for s in stages]

    def stage_layers(self, num_layers: int) -> list[int]:
        """Real decoder layers of each pipeline rank (all its chunks together)."""
        return [sum(map(len, self.chunk_layers(num_layers, r))) for r in range(self.pp)]

    def dp(self, world_size: int) -> int:
        """The data-parallel size on ``world_size`` ranks."""
        return world_size // self.model_parallel_size

    def hierarchical_cp_sizes(self) -> list[int] | None:
        """Megatron's hierarchical CP group sizes for hybrid CP, else None."""
        if self.cp > 1 and self.cp_algo is CPAlgo.HYBRID and self.ulysses_degree:
            return [self.ulysses_degree, self.cp // self.ulysses_degree]
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace | Any) -> Layout:
        """The layout Megatron-LM / MindSpeed flags describe (a parsed namespace; absent
        attributes take Megatron's defaults). The one place VPP is derived."""

        def get(name: str, default: Any = None) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        pp = _int(get("pipeline_model_parallel_size", 1), "--pipeline-model-parallel-size")
        noop = get("noop_layers", ())
        layers = _opt_int(get("num_layers"), "--num-layers")
        if layers is not None and not isinstance(noop, str):  # rewritten: --num-layers is real
            layers += len(noop)  # VPP chunks count slots, noop ones included
        dualpipev = get("schedules_method") == "dualpipev"
        if dualpipev and (
            get("num_layers_per_virtual_pipeline_stage")
            or get("virtual_pipeline_model_parallel_size")
        ):
            raise ValueError(
                "--schedules-method dualpipev places two chunks on each rank itself: remove "
                "--num-layers-per-virtual-pipeline-stage"
            )
        return cls(
            tp=_int(get("tensor_model_parallel_size", 1), "--tensor-model-parallel-size"),
            pp=pp,
            cp=_int(get("context_parallel_size", 1), "--context-parallel-size"),
            cp_algo=CPAlgo.parse(get("context_parallel_algo", "megatron_cp_algo")),
            ulysses_degree=_opt_int(get("ulysses_degree_in_cp"), "--ulysses-degree-in-cp"),
            vpp=virtual_stages(
                layers,
                pp,
                _opt_int(
                    get("num_layers_per_virtual_pipeline_stage"),
                    "--num-layers-per-virtual-pipeline-stage",
                ),
            )
            or _opt_int(get("virtual_pipeline_model_parallel_size"), "--virtual-pipeline-size"),
            sequence_parallel=bool(get("sequence_parallel", False)),
            distributed_optimizer=bool(
                get("use_distributed_optimizer", False) or get("use_megatron_fsdp", False)
            ),
            overlap_grad_reduce=bool(get("overlap_grad_reduce", False)),
            overlap_param_gather=bool(get("overlap_param_gather", False)),
            torch_fsdp2=bool(get("use_torch_fsdp2", False)),
            fsdp2_reshard_after_forward=bool(get("torch_fsdp2_reshard_after_forward", True)),
            megatron_fsdp=bool(get("use_megatron_fsdp", False)),
            fsdp_sharding=str(get("data_parallel_sharding_strategy", "optim_grads_params")),
            bucket_size=get("ddp_bucket_size"),
            **uneven_stages(
                pp,
                _opt_int(
                    get("decoder_first_pipeline_num_layers"), "--decoder-first-pipeline-num-layers"
                ),
                _opt_int(
                    get("decoder_last_pipeline_num_layers"), "--decoder-last-pipeline-num-layers"
                ),
                get("num_layer_list"),
            ),
            ep=_int(get("expert_model_parallel_size", 1), "--expert-model-parallel-size"),
            dualpipev=dualpipev,
            noop_layers=parse_noop_layers(noop),
            dualpipev_dw_detach=dualpipev and bool(get("dualpipev_dw_detach", False)),
            etp=1  # MindSpeed's --moe-tp-extend-ep: the TP ranks widen EP instead
            if get("moe_tp_extend_ep", False)
            else _opt_int(get("expert_tensor_parallel_size"), "--expert-tensor-parallel-size"),
        )

    def validate(self, world_size: int, **sizes: int | None) -> None:
        """Raise ValueError (one line, naming the flag) when the layout cannot work
        (:func:`anyspeed.layout.checks.validate`: ``num_layers``, ``num_attention_heads``,
        ``num_query_groups``, ``seq_length``, ``num_experts``)."""
        layout_checks.validate(self, world_size, **sizes)

    def validate_for(self, world_size: int, model: Any, seq_length: int | None = None) -> None:
        """:meth:`validate` with the sizes (and kinds) read from ``model``."""
        layout_checks.validate_for(self, world_size, model, seq_length)


def virtual_stages(num_layers: int | None, pp: int, layers_per_chunk: int | None) -> int | None:
    """Model chunks per pipeline stage from ``--num-layers-per-virtual-pipeline-stage`` (None
    when not interleaving); ValueError (one line) when the numbers do not fit."""
    if not layers_per_chunk:
        return None
    if pp < 2:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
        )
    if num_layers is None:
        return None
    if num_layers % (pp * layers_per_chunk):
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk}"
        )
    chunks = num_layers // pp // layers_per_chunk
    return chunks if chunks > 1 else None


def _opt_int(value: Any, flag: str) -> int | None:
    return None if value is None else _int(value, flag)


def _int(value: Any, flag: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} expects an integer (got {value!r})") from None


def uneven_stages(pp: int, first: int | None, last: int | None, layer_list: Any) -> dict:
    """First/last stage sizes from Megatron's flags or MindSpeed-LLM's ``--num-layer-list``
    (one count per stage); a list whose middle stages differ, which Megatron-Core 0.16.1
    cannot size, as ``layer_list`` (anyspeed places those layers)."""
    if layer_list in (None, ""):
        return {"first_stage_layers": first, "last_stage_layers": last}
    try:
        counts = [int(x) for x in str(layer_list).split(",")]
    except ValueError:
        raise ValueError(
            f"--num-layer-list {layer_list!r}: give one whole number per stage, "
            "comma-separated (e.g. 3,5)"
        ) from None
    if len(counts) != pp or first is not None or last is not None:
        raise ValueError(
            f"--num-layer-list {layer_list!r} needs one entry per pipeline stage "
            f"({pp}) and no --decoder-first/last-pipeline-num-layers"
        )
    if min(counts) < 1:
        raise ValueError(f"--num-layer-list {layer_list!r}: give every stage at least one layer")
    if pp > 2 and len(set(counts[1:-1])) > 1:  # anyspeed places the layers (chunk-placement)
        return {"layer_list": tuple(counts)}
    if len(set(counts)) == 1:
        return {}
    return {"first_stage_layers": counts[0], "last_stage_layers": counts[-1]}
