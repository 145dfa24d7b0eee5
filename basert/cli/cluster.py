"""`basert cluster`: BaseRT replicas on Ray Serve behind one HTTP address, routed by prompt prefix."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import replace

from basert.cli.serve import StartupError, add_arguments, check_port_free, configure_logging

log = logging.getLogger("basert.cluster")
SET_BY_CLUSTER = ("replica", "exit_with_parent")    # `basert serve` flags the cluster gives each replica itself


def cmd_cluster(args: argparse.Namespace) -> int:
    configure_logging(args.log_file)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("basert cluster needs Ray Serve: pip install 'basert[cluster]' (or 'ray[serve]')")
        return 2
    from basert.cli.generate import model_path_for
    from basert.cluster.app import cluster_config
    from basert.engine.runner import default_threads

    if args.replica is not None or args.exit_with_parent:
        log.error("--replica and --exit-with-parent are set by basert cluster on each replica")
        return 2
    threads = args.threads if args.threads is not None else max(1, default_threads() // max(1, args.replicas))
    try:
        config = cluster_config(args, replicas=args.replicas, threads_per_replica=threads, routing=args.routing)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        check_port_free(args.host, args.port)
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    specs = ([args.model_arg] if args.model_arg else []) + list(args.model)
    models = tuple(str(model_path_for(spec)) for spec in specs or [None])   # converted once, before the replicas
    return run_cluster(replace(config, models=models), address=args.address, host=args.host, port=args.port)


def run_cluster(config, *, address: str | None, host: str, port: int) -> int:
    """Start the application on a Ray cluster (`address`, else a local one) and serve until SIGINT/SIGTERM."""
    import ray
    from ray import serve

    from basert.cluster.app import application

    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        cpus = max(os.cpu_count() or 1, config.replicas * config.threads_per_replica)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        log.info("starting %d replica(s) of %s, %d thread(s) each, %s routing", config.replicas,
                 ", ".join(config.models), config.threads_per_replica, config.routing)
        serve.run(application(config), name="basert", route_prefix="/", blocking=False)
        stop = threading.Event()     # Ray has installed its handlers by now: ours replace them
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda _signum, _frame: stop.set())
        log.info("listening on http://%s:%d (GET /cluster lists the replicas)", host, port)
        while not stop.wait(0.5):
            pass
        log.info("stopping: the replicas drain and save their prefix caches")
        serve.shutdown()
    finally:
        ray.shutdown()
    log.info("stopped")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster", help="serve models from several replicas on Ray Serve, routed by prompt prefix",
        description="Start N BaseRT replicas on a Ray cluster (the one at --address, else a local one) behind Ray "
        "Serve's HTTP proxy at --host:--port, which answers the same API as `basert serve`, streaming included. "
        "Each replica runs `basert serve` with the flags below. A request goes to the replica that last served the "
        "longest prefix of its prompt (its prefix cache holds it), else to the least loaded one; the "
        "X-BaseRT-Replica response header says which. Slot endpoints address one replica: ?replica=K. "
        "GET /cluster lists the replicas, GET /metrics and GET /slots gather all of theirs. "
        "Needs Ray Serve: pip install 'basert[cluster]'.")
    add_arguments(p)
    for action in p._actions:
        if action.dest in SET_BY_CLUSTER:
            action.help = argparse.SUPPRESS
    p.set_defaults(port=8080)
    p.add_argument("--replicas", type=int, default=2, metavar="N", help="replicas to run (default 2)")
    p.add_argument("--threads-per-replica", dest="threads", type=int, metavar="T",
                   help="engine threads of each replica (default: the physical cores divided among the replicas; "
                   "--threads is the same)")
    p.add_argument("--routing", choices=("prefix", "round-robin"), default="prefix",
                   help="prefix: by prompt prefix, falling back to the least loaded replica (default); "
                   "round-robin: in turn, whatever the prompt (for comparison)")
    p.add_argument("--address", metavar="ADDRESS",
                   help="an existing Ray cluster ('auto' finds the local one); default: start a local Ray")
    p.set_defaults(func=cmd_cluster)
