"""A package's home (gpu_manager.sandbox): which mounts a node removes with it, read from
/proc/self/mountinfo's text."""

from __future__ import annotations

from pathlib import Path

from gpufaas.mounts import mounted_under

MOUNTINFO = """\
22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /srv/state/homes/1234 rw,nosuid,nodev - tmpfs tmpfs rw,size=262144k,mode=700,uid=1234,gid=1234
91 22 0:51 / /srv/state/homes/5678 rw,nosuid,nodev - tmpfs tmpfs rw,size=262144k
92 22 0:52 / /srv/state/homes-other/9 rw - tmpfs tmpfs rw
93 22 0:53 / /srv/state/homes/with\\040space rw - tmpfs tmpfs rw
"""


def test_the_mounts_below_a_homes_directory_are_found_and_nothing_beside_it() -> None:
    assert sorted(mounted_under(Path("/srv/state/homes"), MOUNTINFO)) == [
        Path("/srv/state/homes/1234"),
        Path("/srv/state/homes/5678"),
        Path("/srv/state/homes/with space"),
    ]
    assert mounted_under(Path("/srv/elsewhere"), MOUNTINFO) == []
