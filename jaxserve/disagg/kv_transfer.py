"""KV pages between processes through JAX's transfer server (``jax.experimental.transfer``).

The prefill process offers a sequence's gathered pages (``JaxTransfer.offer``: the arrays stay on its device,
registered under a fresh id, for ``OFFER_TIMEOUT_S`` seconds) and sends the id, its server's address and the
arrays' shapes and dtypes in the gRPC header; the decode process pulls them straight onto its own device
(``JaxTransfer.pull``: one connection per prefill server, reused). No page byte goes through Python or the gRPC
stream, which stays the control channel. ``start`` decides whether this path is used: ``--kv-transfer jax``
requires it, ``auto`` uses it where the platform's client starts a transfer server (on jax 0.10 the CPU client
does; TPU and GPU clients depend on the jaxlib build) and otherwise falls back to the gRPC byte stream, ``grpc``
never uses it.

The transfer server listens on ``--kv-host`` (default 127.0.0.1) and checks no credential of its own: whoever
reaches its port and names a live offer gets its pages. So offer ids are drawn at random (``secrets``, 63 bits:
knowing one says nothing of another), and with a cluster secret or cluster TLS (``ClusterSecurity``) this path is
not used at all (``auto`` moves the pages over the authenticated gRPC stream, ``jax`` is refused).

Arrays cross as single-device arrays (the offer moves them onto the mesh's first device; the decode side's
``PageWriter`` spreads them over its own mesh), so the two meshes need not match.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading

from jaxserve.config.network import ClusterSecurity

logger = logging.getLogger(__name__)

KV_TRANSFERS = ("auto", "jax", "grpc")
JAX_UNGUARDED = ("--kv-transfer jax: JAX's transfer server checks no cluster secret and has no TLS; with "
                 "--cluster-secret or --cluster-ssl-certfile use --kv-transfer grpc (or auto)")
OFFER_TIMEOUT_S = 120.0  # pages offered but not pulled (the decode side went away) are dropped after this


class JaxTransfer:
    """A JAX transfer server on this process's first device: ``offer`` arrays, ``pull`` a peer's offer."""

    def __init__(self, host: str):
        import jax
        from jax.experimental import transfer

        self.device = jax.devices()[0]
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.server = transfer.start_transfer_server(self.device.client, bind, [bind])
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.server.address()

    def offer(self, arrays) -> dict:
        """Register ``arrays`` (a tuple of jax arrays) for one pull; returns what the puller needs."""
        import jax
        from jax.sharding import SingleDeviceSharding

        arrays = [jax.device_put(a, SingleDeviceSharding(self.device)) for a in arrays]
        uuid = secrets.randbits(63)  # unguessable: the id is all a puller needs (module doc)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=OFFER_TIMEOUT_S)
        self.server.await_pull(uuid, arrays, timeout=deadline)
        return {"address": self.address, "uuid": uuid}

    def pull(self, offer: dict, parts: list[dict], peer_host: str) -> tuple:
        """The offered arrays (``parts``: their shapes and dtypes), on this process's first device. A peer
        that listens on every interface advertises a wildcard host: ``peer_host`` (its gRPC host) replaces it."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding

        host, _, port = offer["address"].rpartition(":")
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = peer_host
        address = f"{host}:{port}"
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self.server.connect(address)
        sharding = SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(tuple(p["shape"]), jnp.dtype(p["dtype"]), sharding=sharding) for p in parts]
        return tuple(conn.pull(int(offer["uuid"]), specs))


def start(mode: str, host: str, security: ClusterSecurity | None = None) -> JaxTransfer | None:
    """The transfer server ``--kv-transfer`` asks for, listening on ``host``: None for ``grpc``, for ``auto``
    where the platform has none or the cluster is guarded (``security``: a secret or TLS, which this server
    cannot check; logged); ``jax`` raises ValueError naming the flag in both cases."""
    if mode not in KV_TRANSFERS:
        raise ValueError(f"kv_transfer={mode!r} must be one of {', '.join(KV_TRANSFERS)}")
    if mode == "grpc":
        return None
    if security is not None and (security.secret is not None or security.tls):
        if mode == "jax":
            raise ValueError(JAX_UNGUARDED)
        logger.info("KV pages go over the gRPC stream: JAX's transfer server cannot check the cluster secret or "
                    "TLS")
        return None
    try:
        t = JaxTransfer(host)
    except Exception as e:  # noqa: BLE001 - ImportError, or a client without a transfer server
        if mode == "jax":
            raise ValueError(f"--kv-transfer jax: JAX's transfer server does not start on this platform "
                             f"({type(e).__name__}: {e}); use --kv-transfer grpc") from None
        logger.info("JAX's transfer server is not available here (%s: %s); KV pages go over the gRPC stream",
                    type(e).__name__, e)
        return None
    logger.info("KV pages move through JAX's transfer server at %s", t.address)
    return t
