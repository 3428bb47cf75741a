"""How a process's sockets are secured: ``ServerTLS`` (the public API's certificate, vLLM's ``--ssl-*`` flags) and
``ClusterSecurity`` (the channels between jaxserve's own processes: the shared ``--cluster-secret`` and the
``--cluster-ssl-*`` certificate files).

The cluster secret travels in the gRPC metadata / HTTP header ``SECRET_HEADER`` on every call one process makes
to another (decode -> prefill service, router -> replica) and is compared in constant time. ``grpc`` and ``ssl``
objects are built on demand, so importing this module costs nothing.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import ssl

SECRET_HEADER = "x-jaxserve-cluster-secret"
SECRET_ENV = "JAXSERVE_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


def _readable(flag: str, path: str | None) -> None:
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """The public API's TLS (HTTP and gRPC alike): ``certfile`` and ``keyfile`` (PEM); ``ca_certs``: the CAs
    client certificates are checked against; ``cert_reqs``: ``ssl.CERT_NONE`` (0, no client certificate asked),
    ``CERT_OPTIONAL`` (1: checked if sent) or ``CERT_REQUIRED`` (2: mutual TLS), as vLLM's ``--ssl-cert-reqs``."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)

    def __post_init__(self):
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            _readable(flag, path)
        if self.cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs {self.cert_reqs}: must be 0 (none), 1 (optional) or 2 (required)")
        if self.cert_reqs and self.ca_certs is None:
            raise ValueError(f"--ssl-cert-reqs {self.cert_reqs} checks client certificates: give --ssl-ca-certs")

    @classmethod
    def from_flags(cls, certfile: str | None, keyfile: str | None, ca_certs: str | None,
                   cert_reqs: int) -> ServerTLS | None:
        """None when no certificate is given; ValueError naming the flag when the files do not go together."""
        if certfile is None and keyfile is None:
            if ca_certs is not None or cert_reqs:
                raise ValueError("--ssl-ca-certs / --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
            return None
        if certfile is None or keyfile is None:
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both")
        return cls(certfile, keyfile, ca_certs, cert_reqs)

    def uvicorn_options(self) -> dict:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}

    def grpc_credentials(self):
        """``grpc.ssl_server_credentials`` of the same files: a client certificate required with CERT_REQUIRED,
        checked against ``ca_certs`` when one is sent otherwise."""
        import grpc

        return grpc.ssl_server_credentials(
            [(_read(self.keyfile), _read(self.certfile))],
            root_certificates=_read(self.ca_certs) if self.ca_certs else None,
            require_client_auth=self.cert_reqs == int(ssl.CERT_REQUIRED))


@dataclasses.dataclass(frozen=True)
class ClusterSecurity:
    """What guards the channels between jaxserve's processes (prefill service and KV transfer, router ->
    replica). ``secret``: required of every caller (``SECRET_HEADER``) and sent on every call; TLS is on when
    ``certfile``/``keyfile`` (this process's own certificate, presented as a server and as a client) are given:
    a server listens with them, a client trusts ``ca_certs`` (else the system's CAs). With ``ca_certs``, a
    server also requires its callers' certificates to be signed by it (mutual TLS)."""

    secret: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    def __post_init__(self):
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(f"--cluster-secret: at least {MIN_SECRET_CHARS} characters (e.g. "
                             "python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("--cluster-ssl-certfile and --cluster-ssl-keyfile go together: give both")
        if self.ca_certs is not None and self.certfile is None:
            raise ValueError("--cluster-ssl-ca-certs makes every peer show a certificate signed by it: give this "
                             "process's own with --cluster-ssl-certfile and --cluster-ssl-keyfile")
        for flag, path in (("--cluster-ssl-certfile", self.certfile), ("--cluster-ssl-keyfile", self.keyfile),
                           ("--cluster-ssl-ca-certs", self.ca_certs)):
            _readable(flag, path)

    @classmethod
    def from_flags(cls, secret: str | None, certfile: str | None = None, keyfile: str | None = None,
                   ca_certs: str | None = None) -> ClusterSecurity:
        """The flags' values; the secret from ``SECRET_ENV`` when the flag is not given (the flag wins)."""
        return cls(secret if secret is not None else (os.environ.get(SECRET_ENV) or None), certfile, keyfile,
                   ca_certs)

    @property
    def tls(self) -> bool:
        return self.certfile is not None

    def secret_ok(self, presented: str | None) -> bool:
        """Whether a caller's ``SECRET_HEADER`` value is the secret (always true without one)."""
        if self.secret is None:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), self.secret.encode())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata (or HTTP headers) a call to a peer carries."""
        return ((SECRET_HEADER, self.secret),) if self.secret is not None else ()

    def refusal(self) -> str:
        return f"missing or wrong cluster secret: send the --cluster-secret in '{SECRET_HEADER}'"

    # gRPC -----------------------------------------------------------------------------------------------------
    def server_credentials(self):
        """``grpc.ServerCredentials`` for a port peers call, or None (insecure) without TLS."""
        if not self.tls:
            return None
        import grpc

        return grpc.ssl_server_credentials([(_read(self.keyfile), _read(self.certfile))],
                                           root_certificates=_read(self.ca_certs) if self.ca_certs else None,
                                           require_client_auth=self.ca_certs is not None)

    def channel_credentials(self):
        """``grpc.ChannelCredentials`` for calling a peer, or None (insecure) without TLS."""
        if not self.tls:
            return None
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_certs) if self.ca_certs else None,
                                            private_key=_read(self.keyfile), certificate_chain=_read(self.certfile))

    def bind(self, server, address: str) -> int:
        """``server.add_secure_port`` or ``add_insecure_port``; returns the port (0 when it cannot be had)."""
        creds = self.server_credentials()
        return server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)

    def channel(self, target: str, options=(), aio: bool = False):
        """A (``grpc.aio`` with ``aio``) channel to a peer, secure with TLS."""
        import grpc

        make = grpc.aio if aio else grpc
        creds = self.channel_credentials()
        return make.secure_channel(target, creds, options=list(options)) if creds is not None else \
            make.insecure_channel(target, options=list(options))

    def interceptors(self) -> tuple:
        """The ``grpc.server`` interceptor that refuses calls without the secret (UNAUTHENTICATED); none without
        one."""
        return (_SecretInterceptor(self),) if self.secret is not None else ()

    # HTTP (the router's calls to replicas) --------------------------------------------------------------------
    def client_ssl_context(self) -> ssl.SSLContext | None:
        """The ``ssl.SSLContext`` an HTTPS client verifies peers with and shows its own certificate from."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_certs)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx


def _refusing_handler(handler, message: str):
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED."""
    import grpc

    def abort(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


def _presented(details) -> str | None:
    return next((v for k, v in (details.invocation_metadata or ()) if k == SECRET_HEADER), None)


HEALTH_METHODS = "/grpc.health.v1.Health/"


class _SecretInterceptor:
    """For a ``grpc.server``: every method needs the cluster secret."""

    def __init__(self, security: ClusterSecurity):
        self.security = security

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        # gRPC health answers probes (Kubernetes' grpc probe sends no metadata) and tells only SERVING or not
        if handler_call_details.method.startswith(HEALTH_METHODS) or \
                self.security.secret_ok(_presented(handler_call_details)):
            return handler
        return _refusing_handler(handler, self.security.refusal())
