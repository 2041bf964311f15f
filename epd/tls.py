"""Mutual TLS between EPD's own processes (no torch: the router imports this).

Every internal gRPC server (encoder, prefill, decode: their tier service and TensorStore) demands a
client certificate signed by the cluster's CA, and every internal channel (router -> tiers,
encoder -> prefill pushes, consumers -> producers' TensorStore) presents this process's own. A
process without a certificate from that CA cannot call a tier at all, so it can neither read
users' tensors nor push its own into a request.

The files are read once, at start: a process that cannot read them does not start (a
``TlsConfig`` already checked they exist). Certificates are checked against the address's host
(an IP SAN for an IP) unless ``tls_server_name`` names the one name every worker's certificate carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class MutualTls:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    server_name: str | None = None

    @classmethod
    def from_config(cls, config) -> "MutualTls | None":
        """From a ``TlsConfig`` (None when it is off)."""
        if config is None or not config.enabled:
            return None
        return cls(_read(config.tls_cert, "tls_cert"), _read(config.tls_key, "tls_key"),
                   _read(config.tls_ca, "tls_ca"), config.tls_server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self) -> tuple:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def _read(path: str, key: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path}: {err.strerror or err}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{key}: expected a PEM file, {path} has no '-----BEGIN' line")
    return data


# ---- this process's setting -------------------------------------------------------------------------
# A tier process has one identity for all its internal channels; the consumers' channel pool and
# the encoder's pushes read it here instead of having it threaded through every transport call.
_PROCESS_TLS: MutualTls | None = None


def use_for_process(tls: MutualTls | None) -> None:
    global _PROCESS_TLS
    _PROCESS_TLS = tls


def process_tls() -> MutualTls | None:
    return _PROCESS_TLS
