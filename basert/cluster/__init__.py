"""BaseRT on Ray Serve: replicas of `basert serve` behind one ingress that routes each request by its prompt prefix.

`routing` decides (no Ray), `prompts` names a request's prompt in prefix-cache block keys, `router` plugs the
decision into Ray Serve's request router, `deployments` holds the replica and the ingress, `app` assembles them.
Ray is an optional dependency (`pip install 'basert[cluster]'`); only `router`, `deployments` and `app` need it.
"""
