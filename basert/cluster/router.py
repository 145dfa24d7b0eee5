"""Ray Serve's request-router extension point, driven by `RoutingPolicy`.

Ray calls `choose_replicas` for every request to the replica deployment with the request's arguments; the
ingress passes a `Route` as the `route` keyword. Replicas are known by the rank they report in their metadata
(`BaseRTReplica.record_replica_metadata`), stable across a replica's restart. The requests running on each
replica are counted here from Ray's routed/completed callbacks: with one ingress every request passes here.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from basert.cluster.routing import Route, RoutingPolicy


class PrefixAffinityRouter(RequestRouter):
    """Sends a request to the replica that served its prompt prefix last, else to the least loaded one."""

    def initialize_state(self, policy: str = "prefix", overload: int = 8, **_: object) -> None:
        self.policy = RoutingPolicy(policy=policy, overload=overload)
        self.running: dict[ReplicaID, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_rank = {}
        for replica in candidate_replicas:
            rank = replica.replica_metadata.get("rank")
            if rank is not None:
                by_rank[rank] = replica
        route = route_of(pending_request)
        if pending_request is not None:
            # Every call ranks all the replicas there are: when none of them takes the request (or the one it
            # names is down), Ray is to wait and retry with backoff rather than ask again at once.
            pending_request.routing_context.should_backoff = True
        loads = {rank: self.running.get(replica.replica_id, 0) for rank, replica in by_rank.items()}
        order = self.policy.rank_replicas(route, loads)
        return [[by_rank[rank] for rank in level] for level in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        self.running[replica_id] = self.running.get(replica_id, 0) + 1
        rank = self._replicas[replica_id].replica_metadata.get("rank") if replica_id in self._replicas else None
        if rank is not None:
            self.policy.served(route_of(pending_request), rank)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.running.get(replica_id, 0) > 0:
            self.running[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.running.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


def route_of(pending_request: PendingRequest | None) -> Route:
    route = pending_request.kwargs.get("route") if pending_request is not None else None
    return route if isinstance(route, Route) else Route()
