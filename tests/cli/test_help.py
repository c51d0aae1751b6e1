"""``anyspeed --help`` lists every command the dispatcher runs, in its order, and no other."""

from __future__ import annotations

from anyspeed import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = out.split("\ncommands:\n", 1)[1].splitlines()
    listed = [li.split()[1] for li in lines if li.startswith("  anyspeed ")]
    assert len(listed) == len(lines)
    assert listed == list(cli.COMMANDS)
    assert set(cli.USAGE) == set(cli.COMMANDS)  # a usage line for each, none left over
