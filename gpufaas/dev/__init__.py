"""Developer tooling, never loaded by a daemon: a whole cluster on one machine (`local_cluster`), its
supervisor's restart rules (`supervision`) and the etcd it starts (`etcd_server`)."""
