"""`python -m gateway`'s command line with `--with-scheduler`: the scheduler's flags after `--`,
checked at start, with the gateway's shared flags where they say nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import main, split_argv
from gateway.embedded import EmbeddedScheduler
from gateway.settings import DESCRIPTION, PROG, GatewaySettings


def test_the_flags_after_the_first_double_dash_are_the_schedulers() -> None:
    assert split_argv(["--port", "1"]) == (["--port", "1"], [])
    assert split_argv(["--with-scheduler", "--", "--slots", "2", "--", "x"]) == (
        ["--with-scheduler"],
        ["--slots", "2", "--", "x"],
    )


def test_scheduler_flags_without_with_scheduler_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--", "--slots", "2"])
    assert exited.value.code == 2
    assert "pass --with-scheduler" in capsys.readouterr().err


def test_a_flag_the_scheduler_refuses_is_a_usage_error_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--with-scheduler", "--", "--claim-s", "-1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the scheduler's flags (after `--`)" in err and "--claim-s" in err


def test_the_scheduler_takes_the_gateways_etcd_and_credentials_unless_its_flags_say_otherwise(tmp_path: Path) -> None:
    parser = GatewaySettings.parser(PROG, DESCRIPTION)
    gateway = GatewaySettings.from_args(
        ["--insecure", "--etcd", "127.0.0.1:3999", "--root", "/r", "--state-dir", str(tmp_path), "--with-scheduler"],
        PROG,
        DESCRIPTION,
    )
    embedded = EmbeddedScheduler.from_flags(parser, gateway, ["--slots", "2", "--root", "/other"])
    settings = embedded.settings
    assert (settings.etcd, settings.root, settings.insecure, settings.slots) == ("127.0.0.1:3999", "/other", True, "2")
    assert embedded.secret is None and embedded.tls is False  # --insecure: plain links
