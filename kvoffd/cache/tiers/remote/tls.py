"""TLS to the cluster (``rediss://``): one client context, built once at start from the files the
operator names, used by every connection the cluster client opens (each lane's, each slot-map read's,
the reconnects after MOVED/ASK and after a shard restarts).

* ``--remote-tls-ca PATH``: the PEM bundle the shards' certificates must chain to. It replaces the
  system's CAs (a private cluster CA is the usual case, and trusting every public CA besides it would
  let any publicly certified host pose as a shard). Without it: the system's CAs.
* ``--remote-tls-cert PATH`` / ``--remote-tls-key PATH``: the client certificate (PEM, its chain may
  follow it) and its unencrypted private key, for shards run with ``--tls-auth-clients yes``. The key
  is a secret: refused when every user may read it, as the password and MAC secret files are.
* ``--remote-tls-server-name NAME``: the name every shard's certificate must hold (and the SNI sent),
  instead of the host the URL or the slot map names: clusters announce IPs, certificates often name a
  DNS name. Hostname verification is never off.

Every problem with a file is one :class:`TlsError` line naming the flag (the daemon's "cannot start");
a handshake that fails later is a connection error of that shard, with :meth:`Tls.explain`'s hint.
"""

from __future__ import annotations

import os
import socket
import ssl

_CERT = "-----BEGIN CERTIFICATE-----"
_MAX_PEM = 1 << 20  # a CA bundle of a few hundred certificates; a larger file is not what was meant


class TlsError(ValueError):
    """A TLS setting that cannot be used (one line, naming the flag)."""


class Tls:
    """The context and the name checked; thread-safe (``SSLContext.wrap_socket`` is)."""

    def __init__(self, context: ssl.SSLContext, server_name: str | None = None, ca: str | None = None,
                 client: bool = False):
        self.context = context
        self.server_name = server_name or None
        self._ca = ca  # where the trusted CAs came from, for the hint of a failed verification
        self.client = client  # a client certificate is presented

    @classmethod
    def system(cls) -> Tls:
        """``rediss://`` with no TLS flag: the system's CAs (OpenSSL's default paths, ``SSL_CERT_FILE`` and
        ``SSL_CERT_DIR`` included), the shard's own host checked."""
        ctx = _context()
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        return cls(ctx, None, None)

    def wrap(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """Handshake on ``sock`` (its timeout bounds it); the certificate is checked against
        ``server_name`` when given, else against ``host``."""
        return self.context.wrap_socket(sock, server_hostname=self.server_name or host)

    def explain(self, e: BaseException, host: str) -> str:
        """A failed handshake, with what the operator can do about it."""
        if isinstance(e, ssl.SSLCertVerificationError):
            name = self.server_name or host
            if e.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
                return (f"{e.verify_message}: the shard's certificate does not name {name!r} (give the name it "
                        "holds with --remote-tls-server-name)")
            where = f"--remote-tls-ca {self._ca}" if self._ca else "the system's CAs (name the cluster's CA with --remote-tls-ca)"
            return f"{e.verify_message}: the shard's certificate does not chain to a CA in {where}"
        return self.explain_refusal(e)

    def explain_refusal(self, e: BaseException) -> str:
        """A connection that failed before its first reply. In TLS 1.3 the shard judges the client's
        certificate after the client's handshake returned: its refusal is an alert at the first read,
        or (when the client was writing) only a closed connection."""
        text = str(e)
        if isinstance(e, TimeoutError) or "timed out" in text:
            return text
        if "CERTIFICATE_REQUIRED" in text:
            return f"{text} (the shard requires a client certificate: --remote-tls-cert and --remote-tls-key)"
        if any(a in text for a in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR",
                                   "CERTIFICATE_EXPIRED")):
            return f"{text} (the shard refused the client certificate: it must be valid and signed by the CA of its --tls-ca-cert-file)"
        if self.client:
            return (f"{text} (the shard closed the TLS connection before its first reply: did it refuse the client "
                    "certificate? It must be signed by the CA of its --tls-ca-cert-file)")
        return (f"{text} (the shard closed the TLS connection before its first reply: if it requires client "
                "certificates (--tls-auth-clients yes), give --remote-tls-cert and --remote-tls-key)")


def _context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _read_pem(flag: str, path: str, secret: bool = False) -> str:
    try:
        st = os.stat(path)
        if not os.path.isfile(path):
            raise TlsError(f"{flag} {path}: not a file")
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM + 1)
    except OSError as e:
        raise TlsError(f"{flag} {path}: {e.strerror}") from e
    if secret and st.st_mode & 0o004:
        raise TlsError(f"{flag} {path}: readable by every user (chmod 600 it)")
    if len(data) > _MAX_PEM:
        raise TlsError(f"{flag} {path}: larger than {_MAX_PEM >> 20} MiB: not a PEM file")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise TlsError(f"{flag} {path}: not PEM (binary; DER files convert with: openssl x509 -in F -inform der "
                       "-out F.pem)") from None
    if "-----BEGIN " not in text:
        raise TlsError(f"{flag} {path}: not PEM (no -----BEGIN line)")
    return text


def client_tls(ca_file: str = "", cert_file: str = "", key_file: str = "", server_name: str = "") -> Tls:
    """The context for these files (each may be empty), read and checked now."""
    if bool(cert_file) != bool(key_file):
        raise TlsError("--remote-tls-cert and --remote-tls-key go together (the client certificate and its key)")
    ctx = _context()
    if ca_file:
        text = _read_pem("--remote-tls-ca", ca_file)
        if _CERT not in text:
            raise TlsError(f"--remote-tls-ca {ca_file}: no certificate in it (a PEM bundle of CA certificates)")
        try:
            ctx.load_verify_locations(cadata=text)
        except (ssl.SSLError, ValueError) as e:
            raise TlsError(f"--remote-tls-ca {ca_file}: not a PEM certificate bundle ({e})") from None
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)  # as Tls.system()
    if cert_file:
        if _CERT not in _read_pem("--remote-tls-cert", cert_file):
            raise TlsError(f"--remote-tls-cert {cert_file}: no certificate in it")
        key = _read_pem("--remote-tls-key", key_file, secret=True)
        if "PRIVATE KEY-----" not in key:
            raise TlsError(f"--remote-tls-key {key_file}: no private key in it")
        if "ENCRYPTED" in key:
            raise TlsError(f"--remote-tls-key {key_file}: the key is encrypted; the daemon starts unattended and "
                           "needs it unencrypted, 0600 (openssl pkey -in KEY -out PLAIN)")
        try:  # the password callback: never a prompt on the daemon's terminal
            ctx.load_cert_chain(cert_file, key_file, password=lambda: b"")
        except ssl.SSLError as e:
            why = "the key is not the certificate's" if "KEY_VALUES_MISMATCH" in str(e) else str(e)
            raise TlsError(f"--remote-tls-cert {cert_file} / --remote-tls-key {key_file}: {why}") from None
        except OSError as e:
            raise TlsError(f"--remote-tls-cert {cert_file} / --remote-tls-key {key_file}: {e.strerror}") from None
    name = server_name.strip()
    if server_name and (not name or any(c.isspace() or c == "/" for c in name) or name.count(":") == 1):
        raise TlsError(f"--remote-tls-server-name {server_name!r}: a host name or IP address (no port, no scheme)")
    return Tls(ctx, name or None, ca_file or None, client=bool(cert_file))
