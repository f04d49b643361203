"""The balancer's HAProxy configuration (gpufaas.dev.balancer), read section by section."""

from __future__ import annotations

from gpufaas.dev.balancer import BalancerConfig


def sections(config: str) -> dict[str, list[str]]:
    """Each section's header ("backend uploads") -> its directives, comments stripped."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in config.splitlines():
        text = line.split("#", 1)[0].rstrip()
        if not text:
            continue
        if not text.startswith(" "):
            current = found[text] = []
        else:
            current.append(text.strip())
    return found


def test_every_backend_opens_a_connection_per_request() -> None:
    """A request sent on an idle connection that a gateway closed as it died is answered 502 by
    HAProxy and cannot be retried (it was sent): uploads (a deploy's steps) as much as calls."""
    config = BalancerConfig(listen="127.0.0.1:8000", gateways={"g0": "127.0.0.1:8081", "g1": "127.0.0.1:8082"})
    parts = sections(config.render())
    backends = [name for name in parts if name.startswith("backend ")]
    assert backends == ["backend gateways", "backend uploads"]
    for backend in backends:
        assert "option http-server-close" in parts[backend] + parts["defaults"], backend
