"""``--rl-config`` files: what is not a mapping, and a list where one value belongs, are one line
naming the file and the key; keys anyspeed does not read are named in one warning (issue 43,
item 3). The keys it reads become flags (tests/finetune/test_grpo_resume.py)."""

from __future__ import annotations

import pytest

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl.flags import expand_config


def _expand(tmp_path, text: str) -> list[str]:
    f = tmp_path / "rl.yaml"
    f.write_text(text)
    return expand_config(["--stage", "grpo", "--rl-config", str(f)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- 1\n- 2\n", "the file must be a YAML mapping (key: value lines), not a list"),
        ("rl_config: 3\n", "rl_config must be a mapping, not 3"),
        ("generate_config:\n  sampling_config: [1]\n", "sampling_config must be a mapping"),
        ("rl_config:\n  clip_ratio: [0.2, 3]\n", "rl_config.clip_ratio takes one value"),
    ],
)
def test_bad_structure_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    with pytest.raises(UsageError) as info:
        _expand(tmp_path, text)
    line = str(info.value)
    assert "\n" not in line and "rl.yaml" in line and message in line, line


def test_unread_keys_are_named_and_read_ones_become_flags(tmp_path, capsys):
    argv = _expand(
        tmp_path,
        "use_integrated_worker: true\nrl_config:\n  clip_ratio: 0.1\n  blocking: true\n"
        "  verifier_function: [a:b, c:d]\nmegatron_training:\n  lr: 1e-6\n",
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not read: use_integrated_worker, rl_config.blocking" in err
    assert argv[argv.index("--clip-ratio") + 1] == "0.1"
    i = argv.index("--verifier-function")
    assert argv[i + 1 : i + 3] == ["a:b", "c:d"]
