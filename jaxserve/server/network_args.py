"""The serve command's flags for its sockets: TLS of the public API (vLLM's ``--ssl-*`` names), the cluster's
secret and TLS (``--cluster-*``), and the connection bounds; ``check`` turns them into ``args.tls``
(``ServerTLS`` or None), ``args.cluster`` (``ClusterSecurity``) and ``args.connections`` (``ConnectionLimits``)."""

from __future__ import annotations

import argparse
import logging
import ssl

from jaxserve.config.network import SECRET_ENV, SECRET_HEADER, ClusterSecurity, ServerTLS
from jaxserve.server.connections import ConnectionLimits

logger = logging.getLogger("jaxserve.serve")


def add_tls_args(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--ssl-keyfile", default=None, help="the public API's private key (PEM): HTTPS and gRPC over TLS")
    s.add_argument("--ssl-certfile", default=None, help="the public API's certificate chain (PEM)")
    s.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates that client certificates are checked against (with --ssl-cert-reqs)")
    s.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=(0, 1, 2),
                   help="client certificates, as Python's ssl module numbers it: 0 none asked, 1 optional (checked "
                        "against --ssl-ca-certs when sent), 2 required (mutual TLS)")


def add_cluster_args(d: argparse._ArgumentGroup) -> None:
    d.add_argument("--kv-host", default="127.0.0.1",
                   help="--role prefill/decode: the address the prefill service (--kv-port) and JAX's transfer "
                        "server listen on (0.0.0.0: every interface); they carry prompts and KV pages")
    d.add_argument("--cluster-secret", default=None,
                   help=f"a shared secret (16+ characters) between jaxserve's processes: required of every call "
                        f"to a prefill service, and by a server of every call but /health, /live and /metrics "
                        f"(the router sends it; so does any client that calls the server directly), in the "
                        f"header / gRPC metadata '{SECRET_HEADER}'; sent on the calls this process makes. "
                        f"Default: ${SECRET_ENV} if set, else none")
    d.add_argument("--cluster-ssl-certfile", default=None,
                   help="TLS between jaxserve's processes: this process's certificate (PEM), presented by the "
                        "prefill service and on the calls to prefill servers and (router) to replicas")
    d.add_argument("--cluster-ssl-keyfile", default=None, help="its private key (PEM)")
    d.add_argument("--cluster-ssl-ca-certs", default=None,
                   help="the CA peers' certificates are checked against (mutual TLS: a prefill service then "
                        "requires a client certificate signed by it). Default: the system's CAs")


def add_connection_args(s: argparse._ArgumentGroup) -> None:
    d = ConnectionLimits()
    s.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="HTTP connections (and requests in flight) at once; a request beyond it is answered 503")
    s.add_argument("--max-concurrent-rpcs", type=int, default=d.max_concurrent_rpcs,
                   help="gRPC calls in flight at once; one beyond it is answered RESOURCE_EXHAUSTED")
    s.add_argument("--request-header-timeout", type=float, default=d.header_timeout,
                   help="seconds an HTTP request's head (request line and headers) may take to arrive, from its "
                        "first byte (from the connection's opening for the first request); the connection is "
                        "closed past it. Also bounds a gRPC connection's handshake")
    s.add_argument("--request-body-timeout", type=float, default=d.body_timeout,
                   help="seconds an HTTP request's body may take to arrive after its head; the connection is "
                        "closed past it")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.tls``, ``args.cluster`` and ``args.connections``; a bad combination is a one-line error."""
    try:
        args.tls = ServerTLS.from_flags(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        args.cluster = ClusterSecurity.from_flags(args.cluster_secret, args.cluster_ssl_certfile,
                                                  args.cluster_ssl_keyfile, args.cluster_ssl_ca_certs)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.connections = ConnectionLimits(args.max_connections, args.max_concurrent_rpcs,
                                            args.request_header_timeout, args.request_body_timeout)
    except ValueError as e:  # "max_connections=0 must ..." -> "--max-connections=0 must ..."
        name, _, rest = str(e).partition("=")
        flag = {"header_timeout": "request_header_timeout", "body_timeout": "request_body_timeout"}.get(name, name)
        parser.error(f"--{flag.replace('_', '-')}={rest}")
    if args.role in ("prefill", "decode") and args.kv_transfer == "jax" and (
            args.cluster.secret is not None or args.cluster.tls):
        from jaxserve.disagg.kv_transfer import JAX_UNGUARDED

        parser.error(JAX_UNGUARDED)


def kv_events_on_host(args: argparse.Namespace) -> None:
    """KV-cache events: an unset endpoint binds ``--host``; one that opens every interface while ``--host`` is a
    loopback address is logged (it was asked for, and it carries the prompts' token ids)."""
    import dataclasses

    cfg = args.engine_config.kv_events_config
    if cfg is None:
        return
    args.engine_config = dataclasses.replace(args.engine_config,
                                             kv_events_config=dataclasses.replace(cfg, bind_host=args.host))
    if args.host.startswith("127.") or args.host in ("::1", "localhost"):
        wide = [e for e in (cfg.endpoint, cfg.replay_endpoint) if e and ("*" in e or "0.0.0.0" in e or "[::]" in e)]
        if wide:
            logger.warning("--kv-events-config opens %s on every interface while --host is %s: KV-cache events "
                           "carry the prompts' token ids", " and ".join(wide), args.host)
