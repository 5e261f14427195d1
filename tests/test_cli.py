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


def test_bench_names_each_benchmark_and_runs_the_one_named(monkeypatch, capsys):
    """``bench`` alone (or with flags first) is the regression benchmark; ``bench NAME`` runs that
    benchmark's own main with the remaining arguments; an unknown name lists the benchmarks."""
    import importlib

    from megatron_longctx.bench import commands

    assert cli.main(["bench", "list"]) == 0
    listed = capsys.readouterr().out
    for name, (module, _) in commands.BENCHMARKS.items():
        assert f"  {name} " in listed
        assert callable(importlib.import_module(module).main)
    calls = []
    for module in ("regression", "scaling", "packed_balance_bench"):
        monkeypatch.setattr(f"megatron_longctx.bench.{module}.main",
                            lambda argv, module=module: calls.append((module, argv)) or 0)
    assert cli.main(["bench", "--seq-lengths", "512"]) == 0
    assert cli.main(["bench", "packed-balance", "--cp", "8"]) == 0
    assert cli.main(["bench", "--scaling", "--dry-run"]) == 0
    assert calls == [("regression", ["--seq-lengths", "512"]), ("packed_balance_bench", ["--cp", "8"]),
                     ("scaling", ["--dry-run"])]
    assert cli.main(["bench", "scalign"]) == 2
    assert "unknown benchmark 'scalign'" in capsys.readouterr().err
