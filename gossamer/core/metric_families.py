"""Prometheus metric families from gossamer's reported figures, shared by the coordinator and node agents."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: Upper bounds of the staleness histogram buckets (versions), as shards report them.
STALENESS_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64)

Rows = list[tuple[list[str], float]]


def staleness_buckets(histogram: dict[str, int] | dict[int, int]) -> dict[str, float]:
    """Cumulative Prometheus-style buckets of an exact {staleness: count} histogram.

    Returns ``staleness_le_<b>`` for each bound in STALENESS_BOUNDS, ``staleness_count``
    (the +Inf bucket) and ``staleness_sum``, all cumulative since the shard started.
    """
    pairs = [(int(k), int(v)) for k, v in histogram.items()]
    out = {f"staleness_le_{b}": float(sum(v for k, v in pairs if k <= b)) for b in STALENESS_BOUNDS}
    out["staleness_count"] = float(sum(v for _, v in pairs))
    out["staleness_sum"] = float(sum(k * v for k, v in pairs))
    return out


def histogram_buckets(values: dict[str, float]) -> list[tuple[str, float]] | None:
    """The (le, cumulative count) pairs of the ``staleness_le_*`` keys, +Inf last; None if absent."""
    bounds = sorted((int(k.removeprefix("staleness_le_")), v) for k, v in values.items()
                    if k.startswith("staleness_le_") and k.removeprefix("staleness_le_").isdigit())
    if not bounds or "staleness_count" not in values:
        return None
    return [(str(b), v) for b, v in bounds] + [("+Inf", values["staleness_count"])]


def sum_buckets(a: list[tuple[str, float]] | None, b: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Bucket-wise sum of two histograms with the same bounds (`a` may be None)."""
    if a is None:
        return list(b)
    if [le for le, _ in a] != [le for le, _ in b]:
        return a  # different bounds cannot be added; keep the first
    return [(le, x + y) for (le, x), (_, y) in zip(a, b, strict=True)]


def counter(name: str, doc: str, labels: list[str], rows: Rows) -> Metric:
    m = CounterMetricFamily(name, doc, labels=labels)
    for lv, v in rows:
        m.add_metric(lv, v)
    return m


def gauge(name: str, doc: str, labels: list[str], rows: Rows) -> Metric:
    m = GaugeMetricFamily(name, doc, labels=labels)
    for lv, v in rows:
        m.add_metric(lv, v)
    return m
