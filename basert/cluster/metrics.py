"""One Prometheus exposition for a cluster: every replica's metrics, each sample labelled with its replica."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class ReplicaMetrics:
    """A collector that yields replicas' parsed metric families, merged by name, samples labelled `replica`."""

    def __init__(self, texts: Mapping[int, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                target.samples += [sample._replace(labels={**sample.labels, "replica": str(replica)})
                                   for sample in family.samples]
        yield from merged.values()


def merge_replica_metrics(texts: Mapping[int, str]) -> str:
    """The text exposition of every replica's metrics (replica -> its /metrics text)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaMetrics(texts))
    return generate_latest(registry).decode()
