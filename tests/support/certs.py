"""Certificates made at test time by the `openssl` CLI, and bcrypt hashes:
a CA, a server certificate for localhost / 127.0.0.1 signed by it, client
certificates signed by it and by a second, unrelated CA, and web
configuration files that name them."""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import yaml

USER = "prometheus"
PASSWORD = "s3cret-Scrape"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


def make_cert(d: Path, name: str, ca: str, usage: str, san: str = "DNS:localhost,IP:127.0.0.1") -> tuple[Path, Path]:
    """A certificate `name` signed by CA `ca`; usage serverAuth or clientAuth."""
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n"
                                   "basicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


@dataclass
class Pki:
    dir: Path
    ca: Path               # signs the server's and the good client's certificates
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    stranger: tuple[Path, Path]  # a client certificate from another CA

    def web_config(self, name: str = "web.yml", *, client_auth: str | None = None, users: bool = True,
                   **tls: object) -> Path:
        """A web configuration file in the PKI's directory (relative paths, as an operator writes them)."""
        doc: dict = {"tls_server_config": {"cert_file": self.server[0].name, "key_file": self.server[1].name,
                                           **tls}}
        if client_auth:
            doc["tls_server_config"].update(client_auth_type=client_auth, client_ca_file=self.ca.name)
        if users:
            doc["basic_auth_users"] = {USER: hash_password(PASSWORD)}
        path = self.dir / name
        path.write_text(yaml.safe_dump(doc))
        return path


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca, _ = make_ca(d, "ca")
    make_ca(d, "other-ca")
    return Pki(d, ca, make_cert(d, "server", "ca", "serverAuth"), make_cert(d, "client", "ca", "clientAuth"),
               make_cert(d, "stranger", "other-ca", "clientAuth"))


def hash_password(password: str, prefix: str = "$2y$") -> str:
    """As `htpasswd -nBC 4` writes it (cost 4: tests need not be slow)."""
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return prefix + hashed[4:]


def basic(user: str = USER, password: str = PASSWORD) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
