"""The console script dispatches to its sub-commands and rejects unknown ones clearly."""

from megatron_longctx import cli


def test_usage_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("run", "bench", "plan"):
        assert f"  {name}" in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: megatron-longctx" in capsys.readouterr().out
