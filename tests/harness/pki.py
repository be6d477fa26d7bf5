"""Certificates for one test cluster, made fresh for every run (nothing is reused or shared).

One CA signs everything: the API server's serving cert, the admin client cert every component and
test uses (``O=system:masters``), the service-account signing key, and one serving cert per
controller's webhook server on 127.0.0.1. RSA 2048 in PKCS#1 (what every consumer parses).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for cert-controller's rotator (the Training Operator's) to keep our certs: it
# replaces any certificate that expires within 90 days.
_VALID = datetime.timedelta(days=365)
#: The rotator also checks its CA against this name (cert-controller's ``CAName``).
CA_NAMES = ("kfp-nvrx-test-ca", "training-operator-ca")


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    # PKCS#1: cert-controller (the Training Operator's rotator) parses only that format.
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


@dataclass(frozen=True)
class Pair:
    """A certificate and its key on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Leaf:
    """What a leaf certificate says.

    Attributes:
        common_name: Subject CN (the user name for client certs).
        organization: Subject O (the group for client certs).
        dns: DNS subject alternative names.
        ips: IP subject alternative names.
        server: Serving cert (server auth) or client cert (client auth).
    """

    common_name: str
    organization: str | None = None
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    server: bool = True


class PKI:
    """A per-run CA in ``root`` that issues serving and client certificates.

    Args:
        root: Folder for the PEM files (created).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._ca_key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kfp-nvrx-test-ca")])
        self._ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                    .public_key(self._ca_key.public_key())
                    .serial_number(x509.random_serial_number())
                    .not_valid_before(now - datetime.timedelta(minutes=5))
                    .not_valid_after(now + _VALID)
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .add_extension(x509.SubjectAlternativeName(
                        [x509.DNSName(n) for n in CA_NAMES]), critical=False)
                    .add_extension(x509.KeyUsage(True, False, False, False, False, True, True,
                                                 False, False), critical=True)
                    .sign(self._ca_key, hashes.SHA256()))
        self.ca = Pair(_write(root / "ca.crt", _pem_cert(self._ca)),
                       _write(root / "ca.key", _pem_key(self._ca_key), private=True))
        sa = _key()
        self.sa_key = _write(root / "sa.key", _pem_key(sa), private=True)
        self.sa_pub = _write(root / "sa.pub", sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate (the ``caBundle`` of webhook configurations)."""
        return _pem_cert(self._ca)

    def issue(self, name: str, leaf: Leaf, *, folder: Path | None = None,
              cert_file: str | None = None, key_file: str | None = None) -> Pair:
        """Issue a leaf certificate signed by the run's CA.

        Args:
            name: File stem (``<name>.crt`` / ``<name>.key``) unless file names are given.
            leaf: What the certificate says (subject, alternative names, usage).
            folder: Where to write (default: the PKI root).
            cert_file: Certificate file name inside ``folder``.
            key_file: Key file name inside ``folder``.

        Returns:
            The written pair.
        """
        folder = folder or self.root
        folder.mkdir(parents=True, exist_ok=True)
        key = _key()
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, leaf.common_name)]
        if leaf.organization:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, leaf.organization))
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if leaf.server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(x509.Name(attrs))
                   .issuer_name(self._ca.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + _VALID)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in leaf.dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in leaf.ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        return Pair(_write(folder / (cert_file or f"{name}.crt"), _pem_cert(cert)),
                    _write(folder / (key_file or f"{name}.key"), _pem_key(key), private=True))
