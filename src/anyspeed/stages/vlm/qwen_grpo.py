"""``anyspeed posttrain --stage vlm_grpo``: GRPO on a Qwen2-VL / Qwen2.5-VL model, colocated.

Each optimizer step rolls out from the model being trained: every prompt of the step (an
``mllm`` record's turns up to its last assistant turn, with its images and videos) is sampled
``--n-samples-per-prompt`` times in one left-padded batch with the KV cache
(:mod:`anyspeed.inference.qwen_vl`), each completion is scored by the rule rewards of
``--verifier-function`` against the record's last assistant turn, and the group-normalised
advantages weigh the completions' log-probabilities. One update per rollout, so the policy
ratio is 1 (on-policy GRPO, no clipping at work) and there is no KL term and no reference model.
The loss is the global token mean over the completions' tokens (their end token included), the
same at every layout. Each sample draws from its own generator, seeded by its prompt's place in
the data order: the same tokens at every layout.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.stages.vlm.qwen import QwenVLConfig, QwenVLTask
from anyspeed.training.task import LossFunc, StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The rollout's flags (MindSpeed-RL's names, as ``--stage grpo`` takes them)."""
    g = p.add_argument_group("vision-language GRPO")
    g.add_argument("--n-samples-per-prompt", type=int, default=4, help="the group size (4)")
    g.add_argument("--max-response-length", type=int, default=16, help="tokens per completion (16)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0)")
    g.add_argument(
        "--verifier-function",
        nargs="+",
        default=["word_overlap"],
        help="rule rewards against the record's answer: exact_match, word_overlap (default), "
        "or module:function",
    )


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]  # the conversation up to the assistant's turn, its header included
    sample: Any  # qwen_data.Sample of the prompt (its images, videos and grids)
    answer: str  # the record's last assistant turn: what the rule rewards compare with


@dataclass(frozen=True)
class GRPOConfig(QwenVLConfig):
    group: int = 4
    max_response: int = 16
    temperature: float = 1.0
    reward: Any = None  # rewards.resolve(...): (prompts, completions, labels) -> rewards


def plan(args: argparse.Namespace) -> StagePlan:
    """The model, the layout, the flags and the prompts (bad records counted and named)."""
    import dataclasses
    import os

    from anyspeed.layout import Layout
    from anyspeed.stages.common.rl import rewards
    from anyspeed.stages.vlm import qwen
    from anyspeed.stages.vlm.task import report, tokenizer_of

    cfg = qwen.config_of(args)
    if cfg is None:
        raise UsageError("--stage vlm_grpo starts from a Qwen2-VL / Qwen2.5-VL (--load)")
    n, gbs = args.n_samples_per_prompt, args.global_batch_size
    if n < 2 or gbs % n:
        raise UsageError(
            f"--n-samples-per-prompt {n}: at least 2, dividing --global-batch-size {gbs}"
        )
    if args.max_response_length < 1 or args.temperature <= 0:
        raise UsageError("--max-response-length and --temperature must be positive")
    grpo = GRPOConfig(
        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
        group=n,
        max_response=args.max_response_length,
        temperature=args.temperature,
        reward=rewards.resolve(args.verifier_function, None),
    )
    world = int(os.environ.get("WORLD_SIZE") or getattr(args, "nproc_per_node", None) or 1)
    dp = Layout.from_args(args).dp(world)
    if (gbs // n) % dp:
        raise UsageError(
            f"--global-batch-size {gbs} / --n-samples-per-prompt {n} prompts a step: a "
            f"multiple of the {dp} data-parallel ranks (each rolls out whole groups)"
        )
    tok = tokenizer_of(args)
    base = qwen.plan(args, grpo, tok)
    data = prompts(base.data, tok, args.seq_length, args.max_response_length)
    report(args.data_path[0], data)  # the prompts left without room for an answer; none: error
    return StagePlan(None, grpo, data, base.records)


def prompts(data: Any, tok: Any, seq_length: int, max_response: int) -> Any:
    """Each record as a :class:`Prompt`: its tokens up to its last assistant turn's words, and
    those words as text (the reference answer)."""
    from anyspeed.inference.generate import decode
    from anyspeed.stages.vlm.data import VLMData

    out = VLMData([])  # (the records' own problems were reported with the data)
    for s in data.samples:
        end = max(i for i, f in enumerate(s.learn) if f)  # the last assistant turn's end token
        start = end
        while start > 0 and s.learn[start - 1]:
            start -= 1
        if start + max_response > seq_length:
            out.skipped.setdefault("too long", []).append(
                f"a prompt of {start} tokens leaves no room for --max-response-length "
                f"{max_response} within --seq-length {seq_length}"
            )
            continue
        out.samples.append(Prompt(s.tokens[:start], s, decode(tok, s.tokens[start:end])))
    return out


class GRPOTask(QwenVLTask):
    """Rollouts from the policy, rule rewards, the group-normalised policy gradient."""

    name = "vlm_grpo"
    loss_key = "grpo loss"
    metrics = ("reward",)
    cfg: GRPOConfig  # type: ignore[assignment]

    def datasets(self, run: Run) -> list[Any]:
        """Every prompt trains: a rollout has no held-out loss to report."""
        return [(run.data, (0, len(run.data))), None, None]

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        from anyspeed.models.qwen_vl.model import cp_share

        b = next(data_iterator)
        adv, reward = b.pop("advantages"), b.pop("reward")
        mask = cp_share(b.pop("loss_mask"), seq_dim=1)
        nll = model(b.pop("tokens"), labels=b.pop("labels"), **b)  # -log p per token

        def loss_func(output: torch.Tensor):
            logp = -output.float()
            ratio = torch.exp(logp - logp.detach())  # 1, with the policy gradient's grad
            per_token = -adv[:, None].float() * ratio
            total = (per_token * mask).sum()
            count = mask.sum()
            n = torch.tensor(float(len(reward)), device=reward.device)
            metrics = {
                self.loss_key: torch.stack([total.detach().double(), count.double()]),
                "reward": torch.stack([reward.sum().double(), n.double()]),
            }
            return total, count.to(torch.int), metrics

        return nll, loss_func

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        from megatron.core import parallel_state as ps

        from anyspeed.stages.common.gpt_data import num_samples
        from anyspeed.stages.common.instruction_data import sample_order

        assert trainer is not None
        data, rows = dataset
        args, c = run.args, self.cfg
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per_step = args.global_batch_size // c.group  # prompts of one optimizer step
        order = sample_order(rows, max(num_samples(args)), args.seed)
        step = consumed // args.global_batch_size
        while (step + 1) * per_step <= len(order):
            mine = order[step * per_step : (step + 1) * per_step][rank::dp]
            samples = self.rollout(trainer, data, [int(i) for i in mine], args, step, rank)
            mbs = args.micro_batch_size
            yield [
                self.micro(samples[i : i + mbs], args, device) for i in range(0, len(samples), mbs)
            ]
            step += 1

    def rollout(
        self, trainer: Trainer, data: Any, idx: list[int], args: Any, step: int, rank: int
    ) -> list[tuple[Any, list[int], float, float]]:
        """(prompt, completion, reward, advantage) of every sample of ``idx``'s groups."""
        from anyspeed.inference.generate import decode
        from anyspeed.inference.qwen_vl import generate
        from anyspeed.stages.common.rl.objective import group_advantages

        c, tok = self.cfg, self._tokenizer(args)
        group = [data.samples[i] for i in idx for _ in range(c.group)]
        width = max(len(p.tokens) for p in group)
        pad = torch.tensor([width - len(p.tokens) for p in group])
        pad_id = tok.pad_id or 0
        ids = torch.tensor([[pad_id] * int(k) + p.tokens for k, p in zip(pad, group, strict=True)])
        model = trainer.model[0]
        device = next(model.parameters()).device
        vision = self._vision([p.sample for p in group], device)
        gens = [
            torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + i * 131 + j)
            for i in idx
            for j in range(c.group)
        ]  # the same at every DP size
        ends = (tok.eod_id,) if tok.eod_id is not None else ()
        model.eval()
        try:
            out = generate(
                model,
                ids.to(device),
                vision,
                c.max_response,
                self._vocab(),
                ends,
                self._sampler(gens),
                pad=pad,
            )
        finally:
            model.train()
        done = [r + list(ends[:1]) if len(r) < c.max_response else r for r in out]
        texts = [decode(tok, r) for r in out]
        rewards = c.reward([decode(tok, p.tokens) for p in group], texts, [p.answer for p in group])
        adv = group_advantages(torch.tensor(rewards), c.group).tolist()
        return list(zip(group, done, rewards, adv, strict=True))

    def micro(self, samples: list, args: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """One micro-batch: prompt + completion (right-padded), the loss on the completion."""
        from megatron.core import parallel_state as ps

        from anyspeed.stages.vlm.data import VLMData
        from anyspeed.stages.vlm.qwen_data import Sample, micro_batch

        rows = [
            Sample(
                p.tokens + r,
                [False] * len(p.tokens) + [True] * len(r),
                p.sample.images,
                p.sample.videos,
                p.sample.grids,
            )
            for p, r, _, _ in samples
        ]
        pixels = self._pixels_of() if ps.is_pipeline_first_stage() else None
        qwen25 = self.cfg.tower.kind == "qwen2_5_vl"
        b = micro_batch(VLMData(rows), list(range(len(rows))), args.seq_length, pixels, qwen25)
        b["advantages"] = torch.tensor([a for _, _, _, a in samples])
        b["reward"] = torch.tensor([r for _, _, r, _ in samples], dtype=torch.float64)
        return {k: v.to(device) for k, v in b.items()}

    def _vision(self, prompts: list, device: torch.device) -> dict[str, torch.Tensor]:
        from anyspeed.stages.vlm.qwen_data import vision_inputs

        images = [f for p in prompts for f in p.images]
        videos = [v for p in prompts for v in p.videos]
        qwen25 = self.cfg.tower.kind == "qwen2_5_vl"
        return {
            k: v.to(device)
            for k, v in vision_inputs(images, videos, self._pixels_of(), qwen25).items()
        }

    def _sampler(self, gens: list[torch.Generator]) -> Any:
        """Temperature sampling, each row from its own generator (seeded by the prompt's place
        in the data order and the sample: the same tokens at every layout); the vision marker
        tokens never drawn."""
        from anyspeed.inference.sampling import draw, uniforms

        markers = self.cfg.vision().markers
        temperature = self.cfg.temperature

        def pick(logits: torch.Tensor) -> torch.Tensor:
            scaled = logits.float().cpu() / temperature
            probs = scaled.index_fill(1, torch.tensor(markers), -float("inf")).softmax(-1)
            return draw(probs, uniforms(len(probs), row_generators=gens))

        return pick

    def _pixels_of(self) -> Any:
        from anyspeed.data.qwen_vl_pixels import Pixels

        if self._pixels is None:
            self._pixels = Pixels(self.cfg.processor)
        return self._pixels

    def _tokenizer(self, args: Any) -> Any:
        if getattr(self, "_tok", None) is None:
            from anyspeed.stages.vlm.task import tokenizer_of

            self._tok = tokenizer_of(args)
        return self._tok

    def _vocab(self) -> int:
        return int((self.cfg.hf_config.get("text_config") or self.cfg.hf_config)["vocab_size"])


def make_task(run: Run) -> GRPOTask:
    return GRPOTask(run.config)
