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

import functools
import os
import ssl
import tempfile
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

    # the same identity for what is not gRPC (the decode token stream's TCP link, epd.tcp_link)
    def ssl_server_context(self) -> ssl.SSLContext:
        """Demands a client certificate from the cluster's CA, as the gRPC servers do."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED
        return self._with_identity(context)

    def ssl_client_context(self) -> ssl.SSLContext:
        """Checks the server's certificate against the cluster's CA and the host (or ``server_name``:
        see ``ssl_server_hostname``) and presents this process's own. Made once per identity."""
        return _client_context(self)

    def ssl_server_hostname(self, host: str) -> str:
        return self.server_name or host.strip("[]")

    def _with_identity(self, context: ssl.SSLContext) -> ssl.SSLContext:
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cadata=self.ca_pem.decode())
        # ssl loads a key pair from files only: a private directory, gone once it is read
        with tempfile.TemporaryDirectory(prefix="epd-tls-") as private:
            cert, key = os.path.join(private, "cert.pem"), os.path.join(private, "key.pem")
            for path, data in ((cert, self.cert_pem), (key, self.key_pem)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            context.load_cert_chain(cert, key)
        return context


@functools.lru_cache(maxsize=4)
def _client_context(tls: MutualTls) -> ssl.SSLContext:
    return tls._with_identity(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))


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
