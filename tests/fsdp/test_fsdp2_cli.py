"""``anyspeed fsdp2`` as a user runs it: one process end to end (log line, metrics file,
checkpoint, export), and every bad input a one-line error before any process group starts."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from anyspeed.commands.fsdp2 import main
from helpers import fsdp_ranks as R


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from helpers.corpora import write_corpus

    root = tmp_path_factory.mktemp("fsdp_cli")
    return R.text_model(root / "m", "qwen2"), write_corpus(str(root / "corpus"), docs=30)


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("anyspeed fsdp2: error: ")
    return err[0]


def test_one_process_end_to_end(tmp_path, setup, capsys) -> None:
    model_dir, corpus = setup
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    cfg = R.write_config(
        tmp_path / "c.yaml", model_dir, corpus,
        training={"output_dir": str(out), "save_hf_weights": True, "metrics_file": str(metrics)},
    )  # fmt: skip
    assert main([cfg, "--training.max_steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "parameters" in text and "GiB before activations" in text  # the estimate
    lines = [x for x in text.splitlines() if x.startswith(" iteration ")]
    assert len(lines) == 2 and "lm loss:" in lines[1] and "tokens/s:" in lines[1]
    assert [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()] == [1, 2]
    assert (out / "latest").read_text() == "step_2"
    assert os.path.isfile(out / "hf" / "model.safetensors")
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]


def _config(tmp_path, model_dir: str, dataset: str, **sections) -> str:
    return R.write_config(tmp_path / "c.yaml", model_dir, dataset, **sections)


def test_unknown_key_and_section(tmp_path, setup, capsys) -> None:
    model_dir, corpus = setup
    cfg = _config(tmp_path, model_dir, corpus)
    line = _error(capsys, [cfg, "--training.learning_rate", "1e-4"])
    assert "training.learning_rate" in line and "'lr'" in line and "max_steps" in line
    raw = yaml.safe_load(open(cfg))
    raw["optimisation"] = {}
    open(cfg, "w").write(yaml.safe_dump(raw))
    line = _error(capsys, [cfg])
    assert "unknown section 'optimisation'" in line and "training" in line


def test_bad_values(tmp_path, setup, capsys) -> None:
    model_dir, corpus = setup
    cfg = _config(tmp_path, model_dir, corpus)
    assert "training.lr: 'fast' is not a float" in _error(capsys, [cfg, "--training.lr", "fast"])
    assert "parallel.param_dtype" in _error(capsys, [cfg, "--parallel.param_dtype", "fp8"])
    line = _error(capsys, [cfg, "--parallel.cp_size", "2", "--nproc-per-node", "3"])
    assert "cp_size 2 does not divide the 3 ranks" in line
    line = _error(capsys, [cfg, "--parallel.fsdp_size", "4", "--nproc-per-node", "2"])
    assert "fsdp_size 4" in line
    assert "trust_remote_code" in _error(capsys, [cfg, "--model.trust_remote_code", "true"])
    assert "does not exist" in _error(capsys, [str(tmp_path / "none.yaml")])
    line = _error(capsys, [cfg, "--data.dataset", str(tmp_path / "nothing")])
    assert "nothing" in line and ".bin/.idx" in line


def test_model_refusals(tmp_path, setup, capsys) -> None:
    model_dir, corpus = setup
    remote = tmp_path / "remote"
    remote.mkdir()
    cfg_json = json.loads(open(os.path.join(model_dir, "config.json")).read())
    cfg_json["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps(cfg_json))
    line = _error(capsys, [_config(tmp_path, str(remote), corpus)])
    assert "auto_map" in line and "remote code" in line
    gemma = R.text_model(tmp_path / "gemma", "gemma3")
    capsys.readouterr()
    line = _error(capsys, [_config(tmp_path, gemma, corpus), "--parallel.cp_size", "2",
                           "--nproc-per-node", "2"])  # fmt: skip
    assert "sliding-window" in line
    line = _error(capsys, [_config(tmp_path, model_dir, corpus), "--model.freeze", "model.vision"])
    assert "model.freeze: 'model.vision' is no module" in line


def test_bad_conversation_records(tmp_path, setup, capsys, hf_tok: str) -> None:
    from helpers import fsdp_vlm as V

    model_dir = V.qwen25_vl(tmp_path / "vl", hf_tok)
    data = tmp_path / "d"
    data.mkdir()
    path = V.conversations(data, n=4)
    records = json.loads(open(path).read())
    cases = {
        "missing": ({"images": ["gone.png"]}, "does not exist"),
        "tags": ({"images": records[0]["images"] * 2}, "1 <image> tags for 2 images"),
        "broken": ({"images": ["broken.png"]}, "cannot be decoded"),
    }
    (data / "broken.png").write_bytes(b"\x89PNG not really")
    capsys.readouterr()
    for name, (change, expect) in cases.items():
        bad = [dict(records[0], **change)] + records[1:]
        target = data / f"{name}.json"
        target.write_text(json.dumps(bad))
        line = _error(capsys, [_config(tmp_path, model_dir, str(target),
                                       data={"cutoff_len": 256})])  # fmt: skip
        assert f"{name}.json' record 0" in line and expect in line, line


def test_documented_configs_parse() -> None:
    """The example configurations in docs/fsdp2/ use only known keys and valid values."""
    from pathlib import Path

    from anyspeed.fsdp.config import load

    found = sorted((Path(__file__).parents[2] / "docs" / "fsdp2").glob("*.yaml"))
    assert len(found) >= 2
    for path in found:
        cfg = load(str(path))
        assert cfg.model.model_name_or_path and cfg.data.dataset, path
