"""What the newer families' conversion tests share: a tiny random HF model of a preset converted
to torch_dist and back (logits of the converted model computed on the way), and the round
trip's check."""

from __future__ import annotations

from pathlib import Path

import torch


def converted(root: Path, preset: str, tokens: torch.Tensor, seed: int) -> tuple[dict, dict]:
    """(the case's paths, ``convert_ranks.convert_all``'s result) for ``preset``'s tiny model."""
    from anyspeed.testing import run_distributed
    from helpers import convert_ranks

    convert_ranks.tiny_hf_model(root / "hf", preset, seed=seed)
    case = {"hf": str(root / "hf"), "torch_dist": str(root / "dist"),
            "hf_from_dist": str(root / "back")}  # fmt: skip
    res = run_distributed(convert_ranks.convert_all, 1, cases={"c": case}, tokens=tokens,
                          cli_case="c", timeout=300)[0]["c"]  # fmt: skip
    assert res["rc"] == 0, res["stdout"]
    return case, res


def assert_round_trip(case: dict) -> dict[str, torch.Tensor]:
    """Every HF tensor written back equals the original bit for bit; the originals."""
    from test_convert import _load_hf_tensors

    ref = _load_hf_tensors(Path(case["hf"]))
    got = _load_hf_tensors(Path(case["hf_from_dist"]))
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())
    return ref


def assert_layout_logits(root: Path, preset: str, tokens: torch.Tensor, seed: int,
                         layout: dict) -> None:  # fmt: skip
    """``preset``'s tiny random model converted, run at ``layout`` on two processes: every
    rank's logits equal transformers' within the conversion tests' bound."""
    from test_convert import _check

    from anyspeed.convert.verify import hf_logits
    from anyspeed.testing import run_distributed
    from helpers import convert_ranks

    case, _ = converted(root, preset, tokens, seed=seed)
    ranks = run_distributed(convert_ranks.layout_logits, 2, cases={"m": case}, tokens=tokens,
                            **layout, timeout=300)  # fmt: skip
    for rank in ranks:
        _check(hf_logits(root / "hf", tokens), rank["m"]["dist"])
