"""The exporter-toolkit web configuration file (node_exporter's --web.config.file).

Same keys, same meanings, so one file and the Prometheus habits around it work
here too:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS10 .. TLS13; default TLS12
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go's names; TLS 1.2 and below
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      alice: $2y$10$...              # bcrypt, as htpasswd -B writes it

Everything a file names is read and checked when it loads — the certificate
and its key are put into a TLS context, every hash is checked to be a bcrypt
hash — so a bad file is refused whole with one sentence, and the settings in
force are always a complete, working set. Where Python's TLS cannot do what a
key asks (a client certificate requested but not verified), the file is
refused rather than served with a weaker meaning.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.errors import SlatraceError

__all__ = ["CLIENT_AUTH_TYPES", "TlsSettings", "WebConfig", "WebConfigError", "load_web_config"]


class WebConfigError(SlatraceError):
    """One sentence naming the file, the key and what is wrong."""


# exporter-toolkit's client_auth_type values -> what the server asks of a client.
CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# Go asks for a certificate without verifying it in these; OpenSSL (Python's
# TLS) verifies every certificate it asks for, so they cannot mean the same here.
_UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert")

_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
             "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}

# Go's cipher suite names (crypto/tls) -> OpenSSL's. TLS 1.3 suites are not
# configurable in Go either: named, they are accepted and change nothing.
_CIPHERS = {
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": "ECDHE-RSA-DES-CBC3-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

# The response headers exporter-toolkit lets a web config set, and the values it allows.
_HEADERS = {
    "strict-transport-security": None,
    "x-content-type-options": ("nosniff",),
    "x-frame-options": ("deny", "sameorigin"),
    "x-xss-protection": None,
    "content-security-policy": None,
}

_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
             "cipher_suites", "prefer_server_cipher_suites", "curve_preferences")
_HTTP_KEYS = ("headers", "http2")
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


@dataclass(frozen=True)
class TlsSettings:
    """A loaded tls_server_config: the paths, their contents as read, and the
    server context built from them."""

    cert_file: str
    key_file: str
    client_auth_type: str
    client_ca_file: str | None
    min_version: str
    max_version: str | None
    cipher_suites: tuple[str, ...]
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    ca_pem: bytes | None = field(repr=False)
    context: ssl.SSLContext = field(repr=False, compare=False)

    @property
    def requires_client_cert(self) -> bool:
        return self.client_auth_type == "RequireAndVerifyClientCert"


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: TlsSettings | None = None
    users: tuple[tuple[str, bytes], ...] = ()   # user -> bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    files: tuple[str, ...] = ()                  # every file it was read from, for the change watch
    digest: str = ""                             # of every byte read: equal digests, equal settings

    @property
    def users_map(self) -> dict[str, bytes]:
        return dict(self.users)


def load_web_config(path: str) -> WebConfig:
    """Read `path` and every file it names; WebConfigError says what is wrong."""
    raw = _read(path, path, "the web config file")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise WebConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        data = {}
    top = _mapping(data, path, "", _TOP_KEYS)
    digest = hashlib.sha256(raw)
    files = [path]
    base = os.path.dirname(os.path.abspath(path))
    tls = None
    if top.get("tls_server_config") is not None:
        tls = _tls(_mapping(top["tls_server_config"], path, "tls_server_config", _TLS_KEYS), path, base)
        for name, content in ((tls.cert_file, tls.cert_pem), (tls.key_file, tls.key_pem),
                              (tls.client_ca_file, tls.ca_pem)):
            if name is not None:
                files.append(name)
                digest.update(name.encode() + b"\0" + content)
    users = _users(top.get("basic_auth_users"), path)
    http = _mapping(top.get("http_server_config") or {}, path, "http_server_config", _HTTP_KEYS)
    return WebConfig(path=path, tls=tls, users=users, headers=_headers(http.get("headers"), path),
                     files=tuple(files), digest=digest.hexdigest())


def _read(path: str, source: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        where = "" if path == source else f"{source}: "
        raise WebConfigError(f"{where}cannot read {what} {path} ({e.strerror or e})") from None


def _mapping(value: Any, source: str, where: str, known: tuple[str, ...]) -> dict:
    prefix = f"{source}: {where}: " if where else f"{source}: "
    if not isinstance(value, dict):
        raise WebConfigError(f"{prefix}expected a mapping of keys, got {type(value).__name__}")
    for key in value:
        if key not in known:
            raise WebConfigError(f"{prefix}unknown key {key!r} (known keys: {', '.join(known)})")
    return value


def _tls(m: dict, source: str, base: str) -> TlsSettings:
    where = f"{source}: tls_server_config"
    for key in ("cert_file", "key_file"):
        if not isinstance(m.get(key), str) or not m[key]:
            raise WebConfigError(f"{where}: {key} is required (a PEM file)")
    cert_file = os.path.join(base, m["cert_file"])
    key_file = os.path.join(base, m["key_file"])
    auth = m.get("client_auth_type") or "NoClientCert"
    if auth in _UNVERIFIED_AUTH:
        raise WebConfigError(f"{where}: client_auth_type {auth} asks for a certificate without verifying it, "
                             "which this agent's TLS cannot do; use VerifyClientCertIfGiven or "
                             "RequireAndVerifyClientCert with client_ca_file")
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(f"{where}: client_auth_type {auth!r} is not one of "
                             f"{', '.join(list(CLIENT_AUTH_TYPES) + list(_UNVERIFIED_AUTH))}")
    ca_file = os.path.join(base, m["client_ca_file"]) if m.get("client_ca_file") else None
    if ca_file and auth == "NoClientCert":
        raise WebConfigError(f"{where}: client_ca_file is set but client_auth_type is NoClientCert; "
                             "set client_auth_type to VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    if auth != "NoClientCert" and not ca_file:
        raise WebConfigError(f"{where}: client_auth_type {auth} needs client_ca_file, the CA that signs "
                             "the clients' certificates")
    min_version = m.get("min_version") or "TLS12"
    max_version = m.get("max_version") or None
    for key, value in (("min_version", min_version), ("max_version", max_version)):
        if value is not None and value not in _VERSIONS:
            raise WebConfigError(f"{where}: {key} {value!r} is not one of {', '.join(_VERSIONS)}")
    if max_version and _VERSIONS[max_version] < _VERSIONS[min_version]:
        raise WebConfigError(f"{where}: max_version {max_version} is below min_version {min_version}")
    cert_pem = _read(cert_file, source, "cert_file")
    key_pem = _read(key_file, source, "key_file")
    ca_pem = _read(ca_file, source, "client_ca_file") if ca_file else None

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # No TLS 1.3 session tickets: asyncio writes them after the handshake and
    # the first answer then waited ~40 ms (measured with curl: 42 ms to the
    # first byte with tickets, 0.4 ms without). Scrapers keep their connection.
    ctx.num_tickets = 0
    ctx.set_alpn_protocols(["http/1.1"])  # HTTP/1.1 only (http_server_config.http2 is accepted and means nothing)
    ctx.minimum_version = _VERSIONS[min_version]
    if max_version:
        ctx.maximum_version = _VERSIONS[max_version]
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise WebConfigError(f"{where}: cert_file {cert_file} and key_file {key_file} are not a PEM "
                             f"certificate and its private key ({e.reason or e})") from None
    except OSError as e:
        raise WebConfigError(f"{where}: cannot read cert_file or key_file ({e.strerror or e})") from None
    if ca_pem is not None:
        try:
            ctx.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise WebConfigError(f"{where}: client_ca_file {ca_file} holds no PEM certificate "
                                 f"({e.reason or e})") from None
    ctx.verify_mode = CLIENT_AUTH_TYPES[auth]
    suites = m.get("cipher_suites") or []
    if not isinstance(suites, list) or not all(isinstance(s, str) for s in suites):
        raise WebConfigError(f"{where}: cipher_suites must be a list of cipher suite names")
    unknown = [s for s in suites if s not in _CIPHERS and s not in _TLS13_SUITES]
    if unknown:
        raise WebConfigError(f"{where}: cipher_suites: unknown suite {unknown[0]!r} "
                             "(Go's names, e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
    named = [_CIPHERS[s] for s in suites if s in _CIPHERS]
    if named:
        try:
            ctx.set_ciphers(":".join(named))
        except ssl.SSLError:
            raise WebConfigError(f"{where}: cipher_suites: none of {', '.join(suites)} is available "
                                 "in this OpenSSL") from None
    if m.get("prefer_server_cipher_suites", True):
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return TlsSettings(cert_file=cert_file, key_file=key_file, client_auth_type=auth, client_ca_file=ca_file,
                       min_version=min_version, max_version=max_version, cipher_suites=tuple(suites),
                       cert_pem=cert_pem, key_pem=key_pem,
                       ca_pem=ca_pem, context=ctx)


def _users(value: Any, source: str) -> tuple[tuple[str, bytes], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise WebConfigError(f"{source}: basic_auth_users: expected a mapping of user names to bcrypt hashes")
    out = []
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"{source}: basic_auth_users: {user!r} is not a user name (text without ':')")
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(f"{source}: basic_auth_users: the password of {user!r} is not a bcrypt hash "
                                 "($2a$, $2b$ or $2y$, as 'htpasswd -nBC 10 USER' writes it); "
                                 "never put a plain password here")
        out.append((user, hashed.encode("ascii")))
    return tuple(out)


def _headers(value: Any, source: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise WebConfigError(f"{source}: http_server_config: headers: expected a mapping of header names to values")
    out = []
    for name, text in value.items():
        allowed = _HEADERS.get(str(name).lower(), ())
        if allowed == ():
            raise WebConfigError(f"{source}: http_server_config: headers: {name!r} cannot be set "
                                 f"(allowed: {', '.join(_HEADERS)})")
        if not isinstance(text, str) or "\r" in text or "\n" in text:
            raise WebConfigError(f"{source}: http_server_config: headers: {name} needs a one-line text value")
        if allowed is not None and text.lower() not in allowed:
            raise WebConfigError(f"{source}: http_server_config: headers: {name} must be one of "
                                 f"{', '.join(allowed)}")
        out.append((str(name), text))
    return tuple(out)
