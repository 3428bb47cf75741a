"""Who may call what: the API keys (each one a tenant), the admin routes and their own key, the folders admin
routes may read, and each tenant's prefix-cache salt.

Imports nothing of the engine: the router (``--role router``) applies the same rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import Sequence

# The admin routes by group: vLLM's ``VLLM_SERVER_DEV_MODE`` opens the first, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
# the second, ``--enable-admin-endpoints`` both.
DEV_ROUTES = (("POST", "/v1/update_weights"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"))
LORA_ROUTES = (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"))
DEFAULT_MAX_CPU_LORAS = 16


# The paths ``--api-key`` guards, as vLLM's authentication middleware: everything under ``/v1`` (after a proxy's
# ``--root-path``), nothing else: ``/tokenize``, ``/detokenize``, ``/health``, ``/metrics`` stay open.
API_KEY_PREFIX = "/v1"


def needs_api_key(path: str) -> bool:
    """Whether a request for ``path`` needs one of the API keys (when the server has any)."""
    return path.startswith(API_KEY_PREFIX)


def api_keys(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--api-key`` as a tuple of keys (none: no key is asked)."""
    if not value:
        return ()
    return (value,) if isinstance(value, str) else tuple(k for k in value if k)


def matching_key(authorization: str | None, keys: Sequence[str]) -> str | None:
    """The key an ``Authorization: Bearer KEY`` value carries, if it is one of ``keys`` (compared in constant
    time, every key tried); None otherwise."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return matching_token(token.strip(), keys)


def matching_token(token: str | None, keys: Sequence[str]) -> str | None:
    """``token`` if it is one of ``keys`` (compared in constant time, every key tried), else None: the key an
    ``x-api-key: KEY`` header (Anthropic's clients) carries."""
    if not token:
        return None
    given = token.encode()
    found = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()) and found is None:
            found = key
    return found


def tenant_salt(key: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request sent with API key ``key`` (``--cache-salt-per-api-key``): derived from
    the key (never the key itself, which must not reach the KV-cache events), then the request's own
    ``cache_salt`` after it, so a tenant's salts can only split its own pages further, never name another's."""
    if key is None:
        return salt
    tenant = hashlib.sha256(b"jaxserve-tenant\0" + key.encode()).hexdigest()[:32]
    return tenant if salt is None else f"{tenant}/{salt}"


def _root(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


@dataclasses.dataclass(frozen=True)
class AdminConfig:
    """The admin routes a server (or router) serves and who may call them.

    ``dev_routes``: sleep, wake-up, is-sleeping and weight updates; ``lora_routes``: adapter load and unload.
    ``admin_api_key``: the key they need (the API keys do not open them); ``allowed_paths``: the folders whose
    contents ``update_weights`` and ``load_lora_adapter`` may read (resolved, symlinks included);
    ``max_cpu_loras``: adapters registered at once.
    """

    dev_routes: bool = False
    lora_routes: bool = False
    admin_api_key: str | None = None
    allowed_paths: tuple[str, ...] = ()
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS

    def __post_init__(self):
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras!r} must be an integer >= 1")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("admin_api_key must not be empty")
        object.__setattr__(self, "allowed_paths", tuple(dict.fromkeys(_root(p) for p in self.allowed_paths)))

    @property
    def enabled(self) -> bool:
        return self.dev_routes or self.lora_routes

    def routes(self) -> tuple[tuple[str, str], ...]:
        """(method, path) of every admin route served."""
        return (DEV_ROUTES if self.dev_routes else ()) + (LORA_ROUTES if self.lora_routes else ())

    def authorized(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value opens the admin routes (anyone may without an admin key)."""
        return self.admin_api_key is None or matching_key(authorization, (self.admin_api_key,)) is not None

    def resolve(self, path: str) -> str | None:
        """``path`` resolved (``..`` and symlinks followed) if it lies in one of ``allowed_paths``, else None.
        Whether it exists plays no part, so a refusal tells nothing about the server's folders."""
        try:
            real = _root(path)
        except (OSError, ValueError):  # e.g. a NUL byte
            return None
        for root in self.allowed_paths:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return real
        return None
