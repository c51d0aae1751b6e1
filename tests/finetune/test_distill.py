"""On-policy distillation (``--stage distill``): a converted tiny Qwen2 student samples and a
larger teacher of another architecture (the same tokenizer, given as a Hugging Face directory)
scores it. The rollout's log-probs of student and teacher equal transformers' within 1e-5 at
one process and at TP2, and each token's advantage is minus the k1 estimate between them; a
teacher that is the student gives KL 0 and no gradient; supervised k2 takes the steps
policy-gradient k1 takes; the student's KL to a peaked teacher falls as it trains; bad flags
are one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.instruction import VOCAB

TOL = 1e-5


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, hf_tok) -> str:
    """A random Qwen2 of 4 layers of hidden 96 (the student: 2 of 64) made to prefer the same
    tokens in every context, so that a few steps can teach it: every embedding is 10 in its
    first channel, the final norm keeps only that channel, and the output layer reads a
    random preference from it (logits of std ~3, against the student's near-uniform ones)."""
    return save_teacher(str(tmp_path_factory.mktemp("teacher")), layers=4, tok=hf_tok)


def save_teacher(d: str, layers: int, tok: str | None = None, vocab: int = VOCAB) -> str:
    """The teacher saved in ``d`` (with the tokenizer of directory ``tok``, when given)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=96, intermediate_size=192,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      rope_theta=10000.0)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.3 * torch.randn(vocab)
    model.save_pretrained(d)
    if tok:  # as a Hugging Face model directory carries it (the student's: checked equal)
        for name in os.listdir(tok):
            shutil.copy(os.path.join(tok, name), d)
    return d


def cli(student: str, prefix: str, tok: str, teacher: str, *extra: str, iters: int = 2):
    return ["--stage", "distill", "--load", student, "--finetune", "--teacher-model", teacher,
            "--data-path", prefix, "--tokenizer-type", "PretrainedFromHF",
            "--tokenizer-name-or-path", tok, "--seq-length", "96", "--max-response-length",
            "16", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters",
            str(iters), "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--no-progress-bar",
            "--seed", "5", *extra]  # fmt: skip


def hf_logps(hf_dir: str, micro: list[dict]) -> list[torch.Tensor]:
    """transformers' log-probability of each micro-batch's labels ([b, s])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for b in micro:
            logits = model(input_ids=torch.tensor(b["tokens"])).logits.float()
            lp = torch.log_softmax(logits, -1)
            out.append(lp.gather(-1, torch.tensor(b["labels"])[..., None])[..., 0])
    return out


@pytest.mark.parametrize("layout", [
    pytest.param([], marks=pytest.mark.slow),  # fast: the split teacher, the harder case
    ["--tensor-model-parallel-size", "2"],
    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
], ids=["one", "tp2", "pp2"])  # fmt: skip
def test_rollout_logps_and_advantages_equal_transformers(add_prompts, tiny_qwen, hf_tok,
                                                         teacher, layout, tmp_path):  # fmt: skip
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, *layout, "--save", str(tmp_path / "r"))
    ranks = 2 if layout else 1
    got = run_distributed(sft_ranks.distill_rollout, ranks, argv=argv, cli=argv,
                          rows=list(range(8)), timeout=300)  # fmt: skip
    micro = got[-1]  # the last pipeline stage's (the others have no log-probs)
    assert micro is not None and all(r in (None, micro) for r in got)
    student, taught = hf_logps(tiny_qwen, micro), hf_logps(teacher, micro)
    for b, s, t in zip(micro, student, taught, strict=True):
        mask = torch.tensor(b["loss_mask"]) > 0
        old, tea = torch.tensor(b["old_logp"])[mask], torch.tensor(b["teacher_logp"])[mask]
        assert old == pytest.approx(s[mask].tolist(), abs=TOL)
        assert tea == pytest.approx(t[mask].tolist(), abs=TOL)
        assert (old - tea).abs().max() > 0.1  # two different models
        want = (t[mask] - s[mask]).tolist()  # minus k1 = log teacher - log student
        assert torch.tensor(b["advantages"])[mask] == pytest.approx(want, abs=2 * TOL)


def test_a_rule_rewards_group_advantage_adds_to_the_teachers(add_prompts, tiny_qwen, hf_tok,
                                                             teacher, tmp_path):  # fmt: skip
    """With a rule reward (groups of 4) each answer token's advantage is its sequence's
    group-normalised reward, (r - mean) / (std + 1e-6) over its group, plus the distillation
    term log teacher - log student."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, "--n-samples-per-prompt", "4",
               "--verifier-function", "helpers.user_rewards:vowels", "--distill-coef", "0.5",
               "--save", str(tmp_path / "r"))  # fmt: skip
    (micro,) = run_distributed(sft_ranks.distill_rollout, 1, argv=argv, cli=argv,
                               rows=[0, 1], timeout=300)  # fmt: skip
    rewards = torch.tensor([s for b in micro for s in b["scores"]], dtype=torch.float64)
    groups = rewards.view(-1, 4)
    want_group = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    assert want_group.abs().max() > 0.5  # the rewards differ within a group
    rows = [(b, i) for b in micro for i in range(len(b["tokens"]))]
    for (b, i), g in zip(rows, want_group.view(-1).tolist(), strict=True):
        mask = torch.tensor(b["loss_mask"][i]) > 0
        old, tea = torch.tensor(b["old_logp"][i])[mask], torch.tensor(b["teacher_logp"][i])[mask]
        want = g + 0.5 * (tea - old)
        assert torch.tensor(b["advantages"][i])[mask] == pytest.approx(want.tolist(), abs=1e-5)


def test_a_teacher_that_is_the_student_gives_no_signal(add_prompts, tiny_qwen, hf_tok):
    """The student distilled from itself: KL 0 at every token (within the 1e-7 between a
    forward with autograd on and one without), every advantage 0, so the policy loss and its
    gradient are 0 (one step: Adam would blow the 1e-8 left into a step of the learning
    rate's size)."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, tiny_qwen, iters=1)
    (hist,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    assert hist["metrics"]["distill/reverse_kl"] == pytest.approx([0.0], abs=1e-6)
    assert hist["metrics"]["timing/teacher"][0] > 0  # the teacher's pass was timed
    assert "grpo/rewards/mean" not in hist["metrics"]  # no reward: no columns of zeros
    assert hist["grad_norm"] == pytest.approx([0.0], abs=1e-6), hist["grad_norm"]


@pytest.mark.slow  # 16 steps; the fast test below runs two updates for 3
@pytest.mark.parametrize("update", ["policy-gradient", "topk"])
def test_the_students_kl_to_the_teacher_falls(add_prompts, tiny_qwen, hf_tok, teacher, update):
    """16 steps at a constant learning rate take the student's k1 estimate of KL(student ||
    teacher) from about 4 nats to below 0.7 of it (top-k: over the teacher's 16 best)."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, "--lr", "1e-2", "--lr-decay-style",
               "constant", "--distill-update", update, "--distill-topk", "16",
               iters=16)  # fmt: skip
    (hist,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=400)
    kl = hist["metrics"]["distill/reverse_kl"]
    assert sum(kl[-2:]) < 0.7 * sum(kl[:2]), kl


def test_supervised_k2_steps_as_policy_gradient_k1(add_prompts, tiny_qwen, hf_tok, teacher):
    """On the student's own samples (one pass per rollout: ratio 1) the gradient of k2 as a
    loss is that of k1 as a reward, (log student - log teacher) times the score: the two
    updates take the same steps, whose losses differ."""
    run = ["--lr", "1e-2", "--lr-decay-style", "constant"]
    pg = cli(tiny_qwen, add_prompts, hf_tok, teacher, *run, iters=3)
    sup = cli(tiny_qwen, add_prompts, hf_tok, teacher, *run, "--distill-update", "supervised",
              iters=3)  # fmt: skip
    a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=pg, clis=[pg, sup], timeout=400)[0]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert min(a["grad_norm"]) > 0.1
    kl_a, kl_b = a["metrics"]["distill/reverse_kl"], b["metrics"]["distill/reverse_kl"]
    assert kl_b == pytest.approx(kl_a, rel=1e-5) and kl_a[2] != kl_a[0]  # the student moved
    assert a["loss"] != pytest.approx(b["loss"])  # k1 and k2: different values


@pytest.mark.parametrize(("extra", "line"), [
    (["--teacher-model", None], "needs --teacher-model"),
    (["--distill-update", "supervised", "--distill-kl", "kl"], "zero in expectation"),
    (["--teacher-model", "/nonexistent"], "is not a directory"),
    (["--verifier-function", "gsm8k"], "sample 2 or more per prompt"),
    (["--distill-coef", "0"], "--distill-coef must be > 0"),
], ids=["no-teacher", "supervised-k1", "no-dir", "rewards-of-one", "coef"])  # fmt: skip
def test_bad_flags_are_one_line(capsys, add_prompts, tiny_qwen, hf_tok, teacher, extra, line):
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher)
    if extra[0] == "--teacher-model":
        at = argv.index("--teacher-model")
        del argv[at : at + 2]
        extra = [] if extra[1] is None else extra
    assert posttrain(argv + extra) == 2
    # (the one-time notice of the local spec may come first, in a process's first run)
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("anyspeed: ")]
    assert len(err) == 1 and line in err[0], err


@pytest.mark.slow  # converts a second teacher
def test_a_teacher_the_layout_cannot_split_is_refused(capsys, add_prompts, tiny_qwen, hf_tok,
                                                      tmp_path):  # fmt: skip
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    three = save_teacher(str(tmp_path / "t3"), layers=3)
    argv = cli(tiny_qwen, add_prompts, hf_tok, three, "--pipeline-model-parallel-size", "2",
               "--nproc-per-node", "2", "--save", str(tmp_path / "r"))  # fmt: skip
    assert posttrain(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "--teacher-model at the training layout" in err[0], err
    assert "--num-layers 3 is not divisible" in err[0]


def test_the_launcher_checks_the_teacher_at_its_world(monkeypatch, add_prompts, tiny_qwen,
                                                      hf_tok, teacher, tmp_path):  # fmt: skip
    """Before it starts the ranks, anyspeed's launcher checks the teacher against the world it
    is about to start (--nproc-per-node), not a world of one."""
    from anyspeed.stages.prepare import prepare

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, "--tensor-model-parallel-size", "2",
               "--nproc-per-node", "2", "--save", str(tmp_path / "r"))  # fmt: skip
    run, _ = prepare(argv, "launcher", "posttrain")
    assert run.config.extra.model.num_layers == 4 and run.config.extra.update == "policy-gradient"


def test_a_teacher_with_another_tokenizer_is_refused(capsys, add_prompts, tiny_qwen, hf_tok,
                                                     teacher, tmp_path):  # fmt: skip
    """A vocabulary of the same size is not enough: two tokens swapped in the teacher's
    tokenizer.json are refused before any conversion, naming how many tokens moved."""
    from anyspeed.commands.train import posttrain

    other = shutil.copytree(teacher, tmp_path / "t")
    path = os.path.join(other, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    vocab = doc["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.environ.pop("WORLD_SIZE", None)
    argv = cli(tiny_qwen, add_prompts, hf_tok, str(other), "--save", str(tmp_path / "r"))
    assert posttrain(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "its tokenizer differs" in err[0] and "(2 of" in err[0], err
    assert not os.path.exists(tmp_path / "r")  # refused before converting anything


@pytest.mark.slow  # converts a third teacher
def test_a_teacher_with_another_vocabulary_is_refused(capsys, add_prompts, tiny_qwen, hf_tok,
                                                      tmp_path):  # fmt: skip
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    wider = save_teacher(str(tmp_path / "t"), layers=4, vocab=VOCAB + 128)
    argv = cli(tiny_qwen, add_prompts, hf_tok, wider, "--save", str(tmp_path / "r"))
    assert posttrain(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and f"reads a vocabulary of {VOCAB + 128} tokens" in err[0], err


@pytest.mark.parametrize("layout", [
    [], pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
], ids=["one", "pp2"])  # fmt: skip
def test_memory_estimate_of_the_teacher(add_prompts, tiny_qwen, hf_tok, teacher, layout,
                                        tmp_path):  # fmt: skip
    """``anyspeed memory --teacher-model``'s bytes (the architecture read from the teacher's
    directory as that command reads it) equal the parameters the run's teacher holds."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, teacher, *layout, "--save", str(tmp_path / "r"))
    ranks = run_distributed(sft_ranks.teacher_held, 2 if layout else 1, argv=argv, cli=argv,
                            teacher_dir=teacher, timeout=300)  # fmt: skip
    for r in ranks:
        assert r["held"] > 0 and r["estimate"] == r["held"], r


def test_memory_command_names_the_teacher(teacher, tmp_path):
    """``anyspeed memory`` with ``--teacher-model``: a line for the teacher and the peak with
    it; a directory that is neither a checkpoint nor a model is one line."""
    from anyspeed.commands.memory import run
    from anyspeed.errors import UsageError

    flags = ["--model", "tiny-qwen2.5", "--seq-length", "64", "--vocab-size", str(VOCAB)]
    out = run([*flags, "--teacher-model", teacher])
    line = next(x for x in out.splitlines() if "teacher (--teacher-model" in x)
    assert float(line.split()[-2]) > 0 and "peak with them" in out
    with pytest.raises(UsageError, match="neither a checkpoint"):
        run([*flags, "--teacher-model", str(tmp_path)])
