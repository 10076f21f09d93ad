"""Start the Ray Serve side of `kiln serve --replicas N` (or --prefill-replicas P --decode-replicas D) and
serve the OpenAI app on it: the same app, endpoints, streaming, errors and metrics as `kiln serve`, with
ClusterLLM in place of one AsyncLLM.

Ray: a local one-machine cluster by default (no dashboard, replica logs kept out of this terminal), or
an existing cluster at ray_address, whose nodes must have kiln and the engine dir at the same path.
Serve's own HTTP proxy is not started: the ingress is this process's uvicorn.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import require
from kiln.runtime.cluster.routing import POLICIES, RoutingConfig
from kiln.runtime.params import RuntimeConfig

log = logging.getLogger("kiln.cluster")

ENGINE_APP = "kiln"  # and "kiln-prefill" with disaggregation


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 1  # engine replicas; with disaggregation, the decode replicas
    prefill_replicas: int = 0  # > 0: disaggregated prefill and decode
    routing: str = "prefix"
    ray_address: str | None = None  # None: start a local Ray on this machine
    routing_stats_period_s: float = 1.0  # how often each replica reports its cached prefix blocks
    max_ongoing_requests: int | None = None  # per replica, before Serve queues in the router; default 2 x max_num_seqs

    def __post_init__(self) -> None:
        require(self.replicas >= 1, "replicas", ">= 1", self.replicas)
        require(self.prefill_replicas >= 0, "prefill_replicas", ">= 0", self.prefill_replicas)
        require(self.routing in POLICIES, "routing", f"one of {list(POLICIES)}", self.routing)
        require(self.routing_stats_period_s > 0, "routing_stats_period_s", "> 0", self.routing_stats_period_s)
        require(self.max_ongoing_requests is None or self.max_ongoing_requests >= 1, "max_ongoing_requests",
                ">= 1", self.max_ongoing_requests)

    @property
    def num_replicas(self) -> int:
        return self.replicas + self.prefill_replicas


def replica_config(config: RuntimeConfig, options: ClusterOptions) -> RuntimeConfig:
    """Each replica's RuntimeConfig: without --num-threads, the machine's cores shared among the replicas."""
    if config.num_threads is not None:
        return config
    from dataclasses import replace

    return replace(config, num_threads=max(1, (os.cpu_count() or 1) // options.num_replicas))


def start_cluster(engine_dir: str | Path, config: RuntimeConfig, options: ClusterOptions) -> Any:
    """Connect to (or start) Ray, deploy the replicas and return the ClusterLLM on them."""
    connect_ray(options, replica_config(config, options))
    return deploy(engine_dir, config, options)


def connect_ray(options: ClusterOptions, config: RuntimeConfig) -> None:
    """ray.init (local: CPUs for every replica's threads, no dashboard, replica logs not forwarded; or the
    cluster at options.ray_address) and Serve without its HTTP proxy. Nothing when Ray is already up."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report: this machine has no network
    import ray
    from ray import serve

    if not ray.is_initialized():
        if options.ray_address is None:
            threads = config.num_threads or 1
            ray.init(num_cpus=max(os.cpu_count() or 1, options.num_replicas * threads), include_dashboard=False,
                     log_to_driver=False, object_store_memory=512 * 2**20, logging_level=logging.WARNING)
        else:
            ray.init(address=options.ray_address, log_to_driver=False, logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")


def deploy(engine_dir: str | Path, config: RuntimeConfig, options: ClusterOptions, app: str = ENGINE_APP) -> Any:
    """Deploy the engine replicas (and the prefill ones) as Serve apps `app` (and `app`-prefill); the ClusterLLM."""
    from ray import serve

    from kiln.runtime.cluster.ingress import ClusterLLM
    from kiln.runtime.tokenizer import Tokenizer

    engine_dir = Path(engine_dir).resolve()
    config = replica_config(config, options)
    tokenizer = Tokenizer(engine_dir, config.chat_template)  # fails here, in one sentence, for a bad engine dir
    prefill = None
    if options.prefill_replicas:
        prefill = serve.run(_deployment("prefill", options.prefill_replicas, config, options)
                            .bind(str(engine_dir), config), name=f"{app}-prefill", route_prefix=None)
    engine = serve.run(_deployment("engine", options.replicas, config, options).bind(str(engine_dir), config),
                       name=app, route_prefix=None)
    info = engine.info.remote().result()
    log.info("%d engine replica(s)%s of %s on Ray %s, %s thread(s) each, routing %s", options.replicas,
             f" (decode) + {options.prefill_replicas} prefill" if prefill else "", engine_dir,
             options.ray_address or "(local)", config.num_threads, options.routing)
    return ClusterLLM(engine, info, tokenizer, prefill)


def undeploy(app: str = ENGINE_APP) -> None:
    """Delete the Serve apps deploy() made under this name."""
    from ray import serve

    deployed = serve.status().applications
    for name in (app, f"{app}-prefill"):
        if name in deployed:
            serve.delete(name)


def _deployment(name: str, num_replicas: int, config: RuntimeConfig, options: ClusterOptions) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kiln.runtime.cluster.replica import EngineReplica
    from kiln.runtime.cluster.router import KilnRequestRouter

    routing = RoutingConfig(options.routing)
    router_options: dict[str, Any] = {
        "request_router_class": KilnRequestRouter,
        "request_router_kwargs": {"policy": routing.policy},
        "request_routing_stats_period_s": options.routing_stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 5 * options.routing_stats_period_s),
    }
    router = RequestRouterConfig(**router_options)
    deployment: Any = serve.deployment
    return deployment(EngineReplica, name=name).options(
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": config.num_threads},
        max_ongoing_requests=options.max_ongoing_requests or 2 * config.max_num_seqs,
        request_router_config=router,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
    )


def stop_cluster(options: ClusterOptions) -> None:
    """Remove kiln's apps; a local Ray is shut down with them, an existing cluster is only left."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if options.ray_address is None:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    else:
        undeploy(ENGINE_APP)
        ray.shutdown()


def serve_cluster(engine_dir: str | Path, config: RuntimeConfig, options: ClusterOptions,
                  serve_options: Any) -> None:
    """`kiln serve --replicas`: deploy, serve the OpenAI app until SIGTERM/SIGINT, then take the replicas down."""
    from kiln.runtime.server.launch import configure_logging, install_exit_handlers, serve_llm

    configure_logging(serve_options.log_level)
    install_exit_handlers()
    try:
        llm = start_cluster(engine_dir, config, options)
        what = f"{engine_dir} on {options.replicas} replica(s)" + (
            f" + {options.prefill_replicas} prefill" if options.prefill_replicas else "")
        serve_llm(llm, what, serve_options)
    finally:
        stop_cluster(options)
