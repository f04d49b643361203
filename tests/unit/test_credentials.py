"""`python -m gpufaas.credentials`: makes the credential files in a directory, prints the metrics
token, and takes `--help` for help (never for a directory to write secrets into)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpufaas import credentials


def test_help_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        credentials.main(["--help"])
    assert exited.value.code == 0
    assert "DIR" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_makes_the_files_then_prints_the_metrics_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "secrets"
    assert credentials.main([str(directory)]) == 0
    files = credentials.SecretFiles(directory)
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct(os.stat(files.cluster_secret).st_mode & 0o777) == "0o600"
    capsys.readouterr()
    assert credentials.main(["--metrics-token", str(directory)]) == 0
    token = capsys.readouterr().out.strip()
    assert token == credentials.metrics_token(credentials.read_secret(files.cluster_secret))
    with pytest.raises(SystemExit) as exited:
        credentials.main([])  # no DIR: a usage error, not a traceback
    assert exited.value.code == 2


def test_a_secret_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path) -> None:
    # Before, random bytes (`head -c 32 /dev/urandom > cluster-secret`) raised UnicodeDecodeError
    # in a traceback from every daemon, and text was decoded by the locale's encoding.
    path = tmp_path / "cluster-secret"
    path.write_bytes(b"\xa8\xff random bytes\n")
    path.chmod(0o600)
    with pytest.raises(credentials.CredentialError, match="is not UTF-8 text"):
        credentials.read_secret(path)


def test_a_metrics_token_written_again_is_made_0600(tmp_path: Path) -> None:
    # Before, a metrics-token already there kept its mode (0644: readable by every user of the
    # host), since O_CREAT's mode applies only to a file it creates.
    files = credentials.ensure_secrets(tmp_path / "secrets")
    path = credentials.write_metrics_token(files)
    path.chmod(0o644)
    assert credentials.write_metrics_token(files) == path
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_directory_that_cannot_be_used_is_told_in_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a cluster secret written by hand with mode 0644 raised CredentialError in a traceback
    # (from writing the metrics token), and a DIR that is a file raised FileExistsError.
    directory = tmp_path / "secrets"
    directory.mkdir()
    (directory / credentials.CLUSTER_SECRET_FILE).write_text("made by hand\n")
    (directory / credentials.CLUSTER_SECRET_FILE).chmod(0o644)
    assert credentials.main([str(directory)]) == 1
    assert capsys.readouterr().err.strip().endswith(f"run `chmod 600 {directory / 'cluster-secret'}`")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert credentials.main([str(a_file)]) == 1
    assert capsys.readouterr().err == f"error: cannot make the credentials in {a_file}: File exists\n"


def test_tls_hosts_are_taken_as_a_certificate_carries_them_and_others_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a name with non-ASCII letters raised cryptography's ValueError in a traceback (the CA
    # made, no role certificate), and '' or 'a b' went into every certificate as a DNS name.
    from cryptography import x509

    directory = tmp_path / "secrets"
    assert credentials.main([str(directory), "--tls-host", "über.example", "--tls-host", "[fd00::1]"]) == 0
    cert = x509.load_pem_x509_certificate((directory / "tls" / "node.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "xn--ber-goa.example" in sans.get_values_for_type(x509.DNSName)
    assert "fd00::1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    for bad in ("", "a b"):
        with pytest.raises(SystemExit) as exited:
            credentials.main([str(tmp_path / "other"), f"--tls-host={bad}"])
        assert exited.value.code == 2
        assert f"argument --tls-host: {bad!r} is neither an IP address nor a DNS name" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_a_write_that_fails_leaves_no_empty_secret_and_the_next_run_makes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a secret whose write failed (a full disk) or was interrupted was left empty where it
    # was created, and kept by every later run: the cluster's daemons refused it ("is empty").
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, fd: int) -> None:
            self.file = real_fdopen(fd, "wb")

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *_: object) -> None:
            self.file.close()

        def write(self, _: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    directory = tmp_path / "secrets"
    monkeypatch.setattr(os, "fdopen", lambda fd, *_, **__: FullDisk(fd))
    with pytest.raises(OSError, match="No space left"):
        credentials.ensure_secrets(directory)
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == []
    files = credentials.ensure_secrets(directory)
    for path in (files.cluster_secret, files.admin_password, files.invoke_token, files.etcd_password):
        assert len(credentials.read_secret(path)) > 32
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


def test_files_are_made_and_kept_on_a_file_system_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hard_links(*_: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)  # (vfat, some network shares)
    files = credentials.ensure_secrets(tmp_path / "secrets")
    secret = credentials.read_secret(files.cluster_secret)
    credentials.ensure_secrets(files.directory)
    assert credentials.read_secret(files.cluster_secret) == secret
    assert oct(files.tls.key("node").stat().st_mode & 0o777) == "0o600"
