"""Reading the service's Prometheus text (``GET /metrics``) in tests."""

from __future__ import annotations


def metric_value(text: str, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0.0 when there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {k: str(v) for k, v in labels.items()}
    return float(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                     if s.name == name and want.items() <= s.labels.items()))
