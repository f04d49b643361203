"""Drops the GPU device reservations from a rendered compose file (stdin to stdout): what
deploy/compose.local-cpu.yml would do if docker-compose v1 could delete a key in an override."""

import sys

import yaml


def main() -> int:
    rendered = yaml.safe_load(sys.stdin)
    for service in rendered["services"].values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        reservations.pop("devices", None)
        # An emptied block would still be rendered; drop each level that has nothing left.
        if not reservations:
            service.get("deploy", {}).get("resources", {}).pop("reservations", None)
        if not service.get("deploy", {}).get("resources", {}):
            service.get("deploy", {}).pop("resources", None)
        if not service.get("deploy", {}):
            service.pop("deploy", None)
    yaml.safe_dump(rendered, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
