"""Certificates made by the test itself (``trustme``): a CA, a server certificate for 127.0.0.1/localhost and a
client certificate, written as PEM files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trustme


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: str  # the CA's certificate
    cert: str  # the server's chain (also usable as a client's: it names 127.0.0.1)
    key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed none of them

    def ca_bytes(self) -> bytes:
        return Path(self.ca).read_bytes()


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("jaxserve-client@example.org")
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key", "client_cert", "client_key",
                                                      "other_ca")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_pem.write_to_path(paths["key"])
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    client.private_key_pem.write_to_path(paths["client_key"])
    paths["client_cert"].write_bytes(b"".join(blob.bytes() for blob in client.cert_chain_pems))
    trustme.CA().cert_pem.write_to_path(paths["other_ca"])
    return Certs(**{k: str(v) for k, v in paths.items()})
