"""Certificates made in the test (``cryptography``): a CA, and leaf certificates it signs, valid for
127.0.0.1 and one DNS name; a second, unrelated CA plays the stranger."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SERVER_NAME = "epd.internal"


@dataclass
class Identity:
    cert: Path
    key: Path
    ca: Path  # the CA this identity trusts

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, ip: bool = True) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if ip else []
        builder = builder.add_extension(x509.SubjectAlternativeName([*names, x509.DNSName(SERVER_NAME)]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, str]:
    """A CA in ``directory``: -> (its PEM path, its key, its name)."""
    key = ec.generate_private_key(ec.SECP256R1())
    ca_name = f"{name} test CA"
    path = directory / f"{name}-ca.pem"
    path.write_bytes(_cert(ca_name, key, ca_name, key, ca=True).public_bytes(serialization.Encoding.PEM))
    return path, key, ca_name


def issue(directory: Path, ca: tuple[Path, ec.EllipticCurvePrivateKey, str], name: str, *, ip: bool = True
          ) -> Identity:
    """A leaf certificate (client and server) signed by ``ca``, trusting ``ca``; valid for
    ``SERVER_NAME`` and (``ip``) for 127.0.0.1."""
    ca_path, ca_key, ca_name = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(_cert(name, key, ca_name, ca_key, ca=False, ip=ip).public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)
    return Identity(cert_path, key_path, ca_path)


def self_signed(directory: Path, name: str, trusts: Path) -> Identity:
    """A certificate that signs itself (no CA the cluster knows), trusting the cluster's CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(_cert(name, key, name, key, ca=False).public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    return Identity(cert_path, key_path, trusts)
