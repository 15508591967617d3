"""Every `baton` subcommand prints its help (a bare % in a help string breaks argparse's)."""

from __future__ import annotations

import pytest

from baton.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and command in out.splitlines()[0]


def test_the_workers_help_names_its_percentages():
    import argparse

    from baton.engine.step_budget import COLOCATED_PROMPT_SHARE
    from baton.server.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    share = f"{COLOCATED_PROMPT_SHARE:.0%} of a step beside its decodes"  # one %, as printed
    assert share in " ".join(parser.format_help().split())
