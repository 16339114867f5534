"""A throwaway certificate authority and one certificate per task, for ``distrib launch --tls``.

Each task of a launched cluster gets its own key and certificate, signed by a CA made
for this launch only and valid for a few days; every task trusts only that CA, so with
``DISTRIB_TLS_CA`` set the parameter-server RPCs are mutual TLS: a peer must present a
certificate of this launch besides the cluster token. A task's certificate names the
hosts it may be reached at (``localhost`` and the launcher's host) and serves both as
server and as client certificate.

Two backends, the first that is available: the ``cryptography`` package when it is
installed (``pip install 'distrib[tls]'``; not a base dependency), else the ``openssl``
command line (Debian's ``openssl`` package); either one suffices. Keys are EC P-256, written with mode 0600 in a
directory of mode 0700 that the launcher removes when the cluster stops.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     made = make_cluster_certificates(d, ["chief-0", "ps-0"], ["127.0.0.1"])
    ...     sorted(made.tasks), made.backend in ("cryptography", "openssl")
    (['chief-0', 'ps-0'], True)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ClusterCertificates", "make_cluster_certificates", "available_backend"]

_DAYS = 7
_INSTALL_CRYPTOGRAPHY = "pip install 'distrib[tls]'"


@dataclass(frozen=True)
class ClusterCertificates:
    """Paths of the CA certificate and of each task's ``(certificate, key)``; the backend that made them."""

    ca_file: str
    tasks: dict[str, tuple[str, str]]
    backend: str

    def env(self, task: str) -> dict[str, str]:
        """The ``DISTRIB_TLS_*`` variables of one task."""
        cert, key = self.tasks[task]
        return {"DISTRIB_TLS_CERT": cert, "DISTRIB_TLS_KEY": key, "DISTRIB_TLS_CA": self.ca_file}


def _has_cryptography() -> bool:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def available_backend() -> str | None:
    """``"cryptography"`` if that package imports, else ``"openssl"`` if the command exists, else None."""
    if _has_cryptography():
        return "cryptography"
    return "openssl" if shutil.which("openssl") else None


def _split_hosts(hosts: Sequence[str]) -> tuple[list[str], list[str]]:
    names, ips = ["localhost"], []
    for host in hosts:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if host not in names:
                names.append(host)
        else:
            if host not in ips:
                ips.append(host)
    if "127.0.0.1" not in ips:
        ips.append("127.0.0.1")
    return names, ips


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _with_cryptography(directory: str, tasks: Sequence[str], names: list[str], ips: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_DAYS))
        )

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "distrib launch throwaway CA")])
    ca_cert = (
        builder("distrib launch throwaway CA", ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    with open(os.path.join(directory, "ca.crt"), "wb") as f:
        f.write(ca_cert.public_bytes(serialization.Encoding.PEM))
    alt = x509.SubjectAlternativeName(
        [*(x509.DNSName(n) for n in names), *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)]
    )
    for task in tasks:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(task, ca_cert.subject, key)
            .add_extension(alt, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(os.path.join(directory, f"{task}.key"), pem_key(key))
        with open(os.path.join(directory, f"{task}.crt"), "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))


def _openssl(*args: str, cwd: str) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed ({result.returncode}): {result.stderr.strip()[-500:]}")


def _with_openssl(directory: str, tasks: Sequence[str], names: list[str], ips: list[str]) -> None:
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    old = os.umask(0o077)  # keys are written 0600
    try:
        _openssl(
            "req",
            "-x509",
            *curve,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            str(_DAYS),
            "-subj",
            "/CN=distrib launch throwaway CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE,pathlen:0",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory,
        )
        alt = ",".join([*(f"DNS:{n}" for n in names), *(f"IP:{i}" for i in ips)])
        with open(os.path.join(directory, "task.ext"), "w") as f:
            f.write(
                f"subjectAltName={alt}\nbasicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
            )
        for task in tasks:
            _openssl(
                "req", *curve, "-keyout", f"{task}.key", "-out", f"{task}.csr", "-subj", f"/CN={task}", cwd=directory
            )
            _openssl(
                "x509",
                "-req",
                "-in",
                f"{task}.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                f"{task}.crt",
                "-days",
                str(_DAYS),
                "-sha256",
                "-extfile",
                "task.ext",
                cwd=directory,
            )
            os.remove(os.path.join(directory, f"{task}.csr"))
    finally:
        os.umask(old)


def make_cluster_certificates(
    directory: str, tasks: Sequence[str], hosts: Sequence[str], backend: str | None = None
) -> ClusterCertificates:
    """Write a CA and a certificate for each of ``tasks`` (valid for ``hosts``) into ``directory``.

    ``backend`` forces ``"cryptography"`` or ``"openssl"`` (default: :func:`available_backend`).
    The CA's private key is deleted once the task certificates are signed.
    """
    if backend not in (None, "cryptography", "openssl"):
        raise ValueError(f"backend must be 'cryptography' or 'openssl' (or None: the first available), not {backend!r}")
    backend = backend or available_backend()
    if backend is None:
        raise RuntimeError(
            "TLS certificates need the `cryptography` package or the `openssl` command; install one "
            f"({_INSTALL_CRYPTOGRAPHY}, or apt-get install openssl)"
        )
    if backend == "cryptography" and not _has_cryptography():
        raise RuntimeError(
            f"backend='cryptography' needs the cryptography package: {_INSTALL_CRYPTOGRAPHY} "
            "(or leave backend unset: the openssl command is used when it exists)"
        )
    if backend == "openssl" and not shutil.which("openssl"):
        raise RuntimeError(
            "backend='openssl' needs the openssl command (apt-get install openssl), or leave "
            f"backend unset to use the cryptography package ({_INSTALL_CRYPTOGRAPHY})"
        )
    for task in tasks:
        if not task or not all(c.isalnum() or c in "-_" for c in task):
            raise ValueError(f"task name {task!r} must be letters, digits, '-' or '_' (it names files)")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o700)
    names, ips = _split_hosts(hosts)
    (_with_cryptography if backend == "cryptography" else _with_openssl)(directory, tasks, names, ips)
    for leftover in ("ca.key", "ca.srl", "task.ext"):
        try:
            os.remove(os.path.join(directory, leftover))
        except FileNotFoundError:
            pass
    return ClusterCertificates(
        os.path.join(directory, "ca.crt"),
        {t: (os.path.join(directory, f"{t}.crt"), os.path.join(directory, f"{t}.key")) for t in tasks},
        backend,
    )
