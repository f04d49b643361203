"""gpufaas.local_cluster's defaults: the local cluster's own etcd asks for a password."""

from __future__ import annotations

from pathlib import Path

from gpufaas.local_cluster import LocalCluster


def test_a_cluster_that_runs_its_own_etcd_turns_etcds_authentication_on(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)  # as `gpufaas up` makes it (python -m gpufaas.local_cluster)
    assert cluster.etcd_auth is True
    cluster.etcd_endpoint = "127.0.0.1:2379"  # what start() sets once its etcd runs
    argv = cluster._common()
    assert argv[argv.index("--etcd-password-file") + 1] == str(cluster.secrets.etcd_password)


def test_an_etcd_given_to_the_cluster_is_left_as_its_owner_runs_it(tmp_path: Path) -> None:
    shared = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379")  # the tests' shared etcd
    assert shared.etcd_auth is False and "--etcd-password-file" not in shared._common()
    locked = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379", etcd_auth=True)
    assert "--etcd-password-file" in locked._common()
    insecure = LocalCluster(tmp_path, secure=False)  # --insecure daemons: no credentials at all
    insecure.etcd_endpoint = "127.0.0.1:2379"
    assert "--etcd-password-file" not in insecure._common() and insecure.etcd_credentials is None
