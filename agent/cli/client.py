"""HTTP client of the agent's API (and of Prometheus), for the query commands:
plain HTTP, or HTTPS with a CA, a client certificate and basic auth when the
agent is protected by a web configuration."""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from agent.errors import SlatraceError

# Flag -> environment variable; a flag wins over its variable.
ENV = {"ca_file": "SLATRACE_CA_FILE", "cert_file": "SLATRACE_CERT_FILE", "key_file": "SLATRACE_KEY_FILE",
       "user": "SLATRACE_USER", "password_file": "SLATRACE_PASSWORD_FILE"}
ENV_PASSWORD = "SLATRACE_PASSWORD"
_ASK_CREDENTIALS = ("give --user and --password-file (or SLATRACE_USER with SLATRACE_PASSWORD_FILE or "
                    "SLATRACE_PASSWORD)")


class AgentUnreachable(SlatraceError):
    pass


class CredentialsError(SlatraceError):
    """A credentials flag or variable that cannot be used, in one sentence."""


@dataclass(frozen=True)
class Credentials:
    """How to reach a protected endpoint. The password is never a flag's
    value (it would show in `ps` and shell history): a file or a variable."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            which = "--ca-file" if self.ca_file and not os.path.isfile(self.ca_file) else \
                "--ca-file, --cert-file or --key-file"
            raise CredentialsError(f"cannot use {which} ({getattr(e, 'strerror', None) or e})") from None
        return ctx

    def authorization(self) -> str | None:
        if self.user is None:
            return None
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()


def add_credential_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a protected agent (or Prometheus, with --prometheus)")
    g.add_argument("--ca-file", metavar="FILE", help="CA certificate(s) to verify the server's (env SLATRACE_CA_FILE)")
    g.add_argument("--cert-file", metavar="FILE", help="client certificate (env SLATRACE_CERT_FILE)")
    g.add_argument("--key-file", metavar="FILE", help="its private key (env SLATRACE_KEY_FILE)")
    g.add_argument("--user", metavar="NAME", help="basic auth user (env SLATRACE_USER)")
    g.add_argument("--password-file", metavar="FILE",
                   help="file holding the basic auth password (env SLATRACE_PASSWORD_FILE, or the password itself "
                        "in SLATRACE_PASSWORD)")


def credentials_from(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> Credentials:
    values = {k: getattr(args, k, None) or env.get(v) or None for k, v in ENV.items()}
    password = None
    if values["password_file"]:
        try:
            with open(values["password_file"], encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise CredentialsError(f"cannot read the password file {values['password_file']} "
                                   f"({getattr(e, 'strerror', None) or e})") from None
    elif env.get(ENV_PASSWORD):
        password = env[ENV_PASSWORD]
    if values["user"] and password is None:
        raise CredentialsError(f"--user {values['user']} has no password: give --password-file FILE "
                               "(or SLATRACE_PASSWORD_FILE or SLATRACE_PASSWORD)")
    if password is not None and not values["user"]:
        raise CredentialsError("a password is given but no user: give --user (or SLATRACE_USER)")
    if bool(values["cert_file"]) != bool(values["key_file"]):
        raise CredentialsError("a client certificate needs both --cert-file and --key-file "
                               "(or SLATRACE_CERT_FILE and SLATRACE_KEY_FILE)")
    return Credentials(values["ca_file"], values["cert_file"], values["key_file"], values["user"], password)


_credentials = Credentials()


def use_credentials(creds: Credentials) -> None:
    """The credentials of this command's requests (one command, one endpoint)."""
    global _credentials
    _credentials = creds


class FetchError(SlatraceError):
    """An HTTP JSON request that failed: status is None when nothing answered,
    or the HTTP status; detail says what happened; `sentence`, when set, is the
    whole sentence to show (TLS and credentials problems, with the fix)."""

    def __init__(self, status: int | None, detail: str, not_json: bool = False, sentence: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.not_json = not_json
        self.sentence = sentence


def fetch_json(url: str, timeout: float, what: str = "the server", creds: Credentials | None = None) -> dict:
    creds = creds or _credentials
    req = urllib.request.Request(url)
    auth = creds.authorization()
    if auth:
        req.add_header("Authorization", auth)
    https = url.lower().startswith("https:")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=creds.ssl_context() if https else None) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            said = (f"{what} refused the credentials of user {creds.user!r}" if creds.user
                    else f"{what} asks for credentials: {_ASK_CREDENTIALS}")
            raise FetchError(401, "unauthorized", sentence=said) from None
        try:
            detail = json.load(e).get("error", e.reason)
        except (ValueError, AttributeError):
            detail = e.reason
        raise FetchError(e.code, str(detail)) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(None, str(reason), sentence=_tls_sentence(reason, what, https, creds)) from None
    except ValueError:
        raise FetchError(200, "not JSON", not_json=True) from None


def _tls_sentence(reason: object, what: str, https: bool, creds: Credentials) -> str | None:
    """What a TLS failure means for the user, and which flag fixes it."""
    text = str(reason).lower()
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"cannot verify the certificate of {what} ({reason.verify_message}): give the CA that signed it "
                "with --ca-file (or SLATRACE_CA_FILE)")
    if isinstance(reason, ssl.SSLError) and ("certificate required" in text or "bad certificate" in text
                                             or "unknown ca" in text or "handshake failure" in text):
        if creds.cert_file:
            return f"{what} refused the client certificate {creds.cert_file}: it is not signed by a CA it trusts"
        return (f"{what} asks for a client certificate: give --cert-file and --key-file "
                "(or SLATRACE_CERT_FILE and SLATRACE_KEY_FILE)")
    if isinstance(reason, ssl.SSLError) and "wrong version number" in text:
        return f"{what} does not speak TLS: use an http:// URL"
    if not https and ("remote end closed" in text or "reset by peer" in text or "badstatusline" in text):
        return f"{what} closed the connection without answering HTTP: if it serves HTTPS, use an https:// URL"
    return None


def get(agent: str, path: str, params: dict | None = None, timeout: float = 5.0) -> dict:
    url = agent.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        return fetch_json(url, timeout, what=f"the agent at {agent}")
    except FetchError as e:
        if e.sentence:
            raise AgentUnreachable(e.sentence) from None
        if e.not_json:
            raise AgentUnreachable(f"the agent at {agent} did not answer JSON on {path}") from None
        if e.status is not None:
            raise AgentUnreachable(f"the agent at {agent} answered {e.status}: {e.detail}") from None
        raise AgentUnreachable(f"cannot reach the agent at {agent} ({e.detail}): is 'slatrace run' running? "
                               "(use --agent URL for another address)") from None
