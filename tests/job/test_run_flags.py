"""``megatron-longctx run`` refuses a bad flag itself, in one line naming the flag and its choices, before
any rank starts (Megatron's flags and ours, parsed with Megatron's own parser as every rank will)."""

import pytest

pytest.importorskip("megatron.training")


def _run(monkeypatch, capsys, tmp_path, *flags):
    from megatron_longctx.job import pretrain

    spawned = []
    monkeypatch.setattr(pretrain, "run_phase", lambda *a, **k: spawned.append(a) or 0)
    monkeypatch.setattr(pretrain, "ensure_corpus", lambda own, seq_length: str(tmp_path), raising=False)
    rc = pretrain.main(["--output-dir", str(tmp_path / "run"), *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatron-longctx run")]
    return rc, err, spawned


def test_our_flag_with_a_bad_choice_is_one_line_from_run(monkeypatch, capsys, tmp_path):
    from megatron_longctx.job.pretrain import EXIT_BAD_ARGS

    rc, err, spawned = _run(monkeypatch, capsys, tmp_path, "--longctx-offload-target", "nvme",
                            "--longctx-offload-policy", "checkpoint")
    assert rc == EXIT_BAD_ARGS and spawned == []
    assert len(err) == 1 and "--longctx-offload-target" in err[0] and "'host', 'disk'" in err[0], err


def test_megatrons_flag_with_a_value_we_cannot_run_is_one_line_from_run(monkeypatch, capsys, tmp_path):
    from megatron_longctx.job.pretrain import EXIT_BAD_ARGS

    rc, err, spawned = _run(monkeypatch, capsys, tmp_path, "--cp-comm-type", "ring")
    assert rc == EXIT_BAD_ARGS and spawned == []
    assert len(err) == 1 and "--cp-comm-type" in err[0] and "'p2p'" in err[0] and "'all_gather'" in err[0], err


def test_a_good_command_line_passes_the_check():
    from megatron_longctx.job.command_line import check_flags

    check_flags([])  # the main job's defaults
    check_flags(["--cp-comm-type", "p2p", "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "host"])
