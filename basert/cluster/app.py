"""A BaseRT cluster as a Ray Serve application: N replicas behind one ingress, routed by prompt prefix.

`application(config)` is what `basert cluster` runs; `build` is the same for Ray Serve's own tools:

    serve run basert.cluster.app:build model=smollm2 replicas=2 threads_per_replica=1 \\
        serve_args="--max-context 8192 --prefix-cache-file /var/cache/basert/pc"

or, in a Serve config file, `import_path: basert.cluster.app:build` with those keys under `args`.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from basert.cluster.routing import POLICIES

HEALTH_CHECK_PERIOD_S = 2.0      # a replica whose server died is noticed within this and replaced
HEALTH_CHECK_TIMEOUT_S = 10.0
CACHE_SAVE_INTERVAL_S = 60.0     # a replica's --prefix-cache-save-interval unless the flags set one
# Flags the cluster sets itself on every replica's `basert serve`.
CLUSTER_SET = frozenset({"model_arg", "model", "host", "port", "threads", "replica", "exit_with_parent"})


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What a cluster runs: its models (.base paths), the replicas' `basert serve` flags, and their number."""

    models: tuple[str, ...]
    serve_args: tuple[str, ...] = ()
    replicas: int = 2
    threads_per_replica: int = 1
    routing: str = "prefix"
    max_ongoing_requests: int = 68      # per replica: its slots and queue; beyond, its server answers 503
    overload: int = 8                   # requests on a prefix's replica before it goes elsewhere: 2 x slots
    max_body_bytes: int = 32 * 1024 * 1024   # the replicas' limit, which the ingress applies before routing
    api_keys: bool = False              # the replicas check keys; without, the ingress keeps slots and files local
    allowed_hosts: tuple[str, ...] = ()  # without keys: the Host names answered besides IPs and localhost
    chat_template: str | None = None
    alias: str | None = None

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        if self.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.threads_per_replica < 1:
            raise ValueError("--threads-per-replica must be at least 1")
        if self.routing not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}")


def serve_parser() -> argparse.ArgumentParser:
    from basert.cli.serve import add_arguments

    parser = argparse.ArgumentParser(prog="basert serve", add_help=False)
    add_arguments(parser)
    return parser


def serve_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The `basert serve` command-line flags that reproduce `args` (those the cluster does not set itself).

    Every option whose value differs from its default is written by an action of the parser that stores it, so
    parsing the result gives `args` back.
    """
    flags: list[str] = []
    done: set[str] = set()
    for action in parser._actions:
        dest = action.dest
        if dest in CLUSTER_SET or dest in done or not action.option_strings or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value == parser.get_default(dest):
            continue
        written = flag_for(parser, dest, value)
        if written is None:
            raise ValueError(f"cannot pass {action.option_strings[0]} to the replicas")
        flags += written
        done.add(dest)
    return flags


def flag_for(parser: argparse.ArgumentParser, dest: str, value) -> list[str] | None:
    """The flags of the first action storing `value` into `dest`."""
    for action in parser._actions:
        if action.dest != dest or not action.option_strings:
            continue
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            return [option if value else f"--no-{option[2:]}"]
        if isinstance(action, (argparse._StoreConstAction, argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if action.const == value:
                return [option]
            continue
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (option, str(item))]
        if isinstance(action, argparse._StoreAction):
            return [option, str(value)]
    return None


def cluster_config(serve_args: argparse.Namespace, *, models: list[str] | tuple[str, ...] = (), replicas: int,
                   threads_per_replica: int, routing: str) -> ClusterConfig:
    """The config of a cluster of `models` (.base paths) whose replicas serve with `serve_args`; ValueError names
    a flag that cannot work."""
    from basert.cli.serve import check_arguments, engine_options

    problem = check_arguments(serve_args)
    if problem:
        raise ValueError(problem)
    slots = engine_options(serve_args).n_slots
    if serve_args.prefix_cache_file is not None and not serve_args.prefix_cache_save_interval:
        # A replica may be killed rather than stopped: saving now and then keeps its restart warm.
        serve_args = argparse.Namespace(**{**vars(serve_args), "prefix_cache_save_interval": CACHE_SAVE_INTERVAL_S})
    config = ClusterConfig(
        models=tuple(models), serve_args=tuple(serve_flags(serve_args, serve_parser())), replicas=replicas,
        threads_per_replica=threads_per_replica, routing=routing, max_ongoing_requests=slots + serve_args.max_queued,
        overload=2 * slots, max_body_bytes=serve_args.max_body_bytes,
        api_keys=bool(serve_args.api_key or serve_args.api_key_file),
        allowed_hosts=(serve_args.host, *serve_args.allowed_host),
        chat_template=str(serve_args.chat_template) if serve_args.chat_template else None, alias=serve_args.alias)
    config.check()
    return config


def application(config: ClusterConfig):
    """The Ray Serve application of a cluster."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from basert.cluster.deployments import BaseRTIngress, BaseRTReplica
    from basert.cluster.router import PrefixAffinityRouter

    config.check()
    if not config.models:
        raise ValueError("a cluster serves at least one model")
    replica = serve.deployment(
        BaseRTReplica, name="BaseRTReplica", num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.threads_per_replica},
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"policy": config.routing,
                                                                         "overload": config.overload}),
    )
    ingress = serve.deployment(BaseRTIngress, name="BaseRTIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    replicas = replica.bind(list(config.models), list(config.serve_args), config.threads_per_replica)
    return ingress.bind(replicas, list(config.models), config.replicas, config.chat_template, config.alias,
                        config.max_body_bytes, config.api_keys, list(config.allowed_hosts))


def build(args: dict):
    """`serve run basert.cluster.app:build model=M replicas=N threads_per_replica=T routing=R serve_args="..."`."""
    from basert.cli.generate import model_path_for

    parser = serve_parser()
    serve_args = parser.parse_args(shlex.split(str(args.get("serve_args", ""))))
    specs = [spec for spec in str(args.get("model", "")).split(",") if spec] or [None]
    config = cluster_config(serve_args, models=[str(model_path_for(spec)) for spec in specs],
                            replicas=int(args.get("replicas", 2)),
                            threads_per_replica=int(args.get("threads_per_replica", 1)),
                            routing=str(args.get("routing", "prefix")))
    return application(config)
