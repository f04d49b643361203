"""Reading a Prometheus exposition the way a Prometheus server does (prometheus_client's parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels`, summed over the others
    (0.0 when there is none): e.g. sample(text, "gateway_function_invocation_total", code="200")."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
