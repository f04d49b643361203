"""`python -m gateway`'s command line with `--with-scheduler` and `--with-node`: each embedded
service's flags in a `--` section of its own, checked at start, with the gateway's shared flags
where they say nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.embedded import EmbeddedNode, EmbeddedScheduler, split_argv
from gateway.settings import DESCRIPTION, PROG, GatewaySettings


def test_each_double_dash_opens_the_flags_of_the_service_it_names() -> None:
    assert split_argv(["--port", "1"]) == (["--port", "1"], {})
    assert split_argv(["--with-node", "--", "scheduler", "--slots", "2", "--", "node", "--gpus", "3"]) == (
        ["--with-node"],
        {"scheduler": ["--slots", "2"], "node": ["--gpus", "3"]},
    )
    assert split_argv(["--", "node", "--", "scheduler"]) == ([], {"node": [], "scheduler": []})


def test_a_first_section_that_opens_with_a_flag_is_the_schedulers() -> None:
    assert split_argv(["--with-scheduler", "--", "--slots", "2"]) == (
        ["--with-scheduler"],
        {"scheduler": ["--slots", "2"]},
    )
    assert split_argv(["--with-node", "--"]) == (["--with-node"], {})  # a trailing `--` says nothing
    assert split_argv(["--", "node", "--gpus", "2", "--"]) == ([], {"node": ["--gpus", "2"]})


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--", "--slots", "2", "--", "--gpus", "2"], "each `--` opens the flags of `scheduler` or `node`"),
        (["--", "nodes", "--gpus", "2"], "`-- nodes`"),
        (["--", "node", "--", "node"], "the node's flags are given twice"),
        (["--", "--slots", "1", "--", "scheduler"], "the scheduler's flags are given twice"),
    ],
)
def test_a_section_named_by_another_word_or_twice_is_refused(argv: list[str], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        split_argv(argv)


def test_a_bad_section_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--with-node", "--", "nod", "--gpus", "2"])
    assert exited.value.code == 2
    assert "`-- nod`" in capsys.readouterr().err


@pytest.mark.parametrize(("section", "flag"), [("scheduler", "--with-scheduler"), ("node", "--with-node")])
def test_a_services_flags_without_its_with_flag_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str, flag: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--", section, "--log-level", "info"])
    assert exited.value.code == 2
    assert f"pass {flag}" in capsys.readouterr().err


def test_a_nodes_flags_given_unnamed_are_taken_for_a_schedulers_and_the_error_says_where_they_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--with-node", "--", "--gpus", "2"])
    assert exited.value.code == 2
    assert "put a node's after `-- node`" in capsys.readouterr().err


def test_a_flag_the_scheduler_refuses_is_a_usage_error_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--with-scheduler", "--", "--claim-s", "-1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the scheduler's flags (after `-- scheduler`)" in err and "--claim-s" in err


def test_a_node_without_its_state_dir_is_a_usage_error_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), "--with-node", "--", "node", "--gpus", "2"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the node's flags (after `-- node`)" in err and "state" in err


def gateway_settings(tmp_path: Path, *more: str) -> GatewaySettings:
    return GatewaySettings.from_args(
        ["--insecure", "--etcd", "127.0.0.1:3999", "--root", "/r", "--state-dir", str(tmp_path / "gw"), *more],
        PROG,
        DESCRIPTION,
    )


def test_the_scheduler_takes_the_gateways_etcd_and_credentials_unless_its_flags_say_otherwise(tmp_path: Path) -> None:
    parser = GatewaySettings.parser(PROG, DESCRIPTION)
    gateway = gateway_settings(tmp_path, "--with-scheduler")
    embedded = EmbeddedScheduler.from_flags(parser, gateway, ["--slots", "2", "--root", "/other"])
    settings = embedded.settings
    assert (settings.etcd, settings.root, settings.insecure, settings.slots) == ("127.0.0.1:3999", "/other", True, "2")
    assert embedded.secret is None and embedded.tls is False  # --insecure: plain links


def test_the_node_takes_the_gateways_etcd_and_credentials_unless_its_flags_say_otherwise(tmp_path: Path) -> None:
    parser = GatewaySettings.parser(PROG, DESCRIPTION)
    gateway = gateway_settings(tmp_path, "--with-node")
    flags = ["--state-dir", str(tmp_path / "node"), "--node", "n7", "--gpus", "3", "--backend", "cpu", "--root", "/o"]
    embedded = EmbeddedNode.from_flags(parser, gateway, flags)
    settings = embedded.settings
    assert (settings.etcd, settings.root, settings.insecure, settings.node) == ("127.0.0.1:3999", "/o", True, "n7")
    assert [device.gpu_id for device in embedded.machine.devices] == ["gpu0", "gpu1", "gpu2"]
    assert embedded.secret is None and embedded.tls is False
