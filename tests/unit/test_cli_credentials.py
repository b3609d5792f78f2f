"""The query commands' credentials: flags over variables, the password from a
file or a variable only, and one sentence for each thing that is missing —
against the agent's real HTTPS server, made with openssl-made certificates."""

from __future__ import annotations

import argparse

import pytest

from agent.cli.client import (AgentUnreachable, CredentialsError, add_credential_flags, credentials_from, get,
                              use_credentials)
from agent.transport.access import WebAccess
from tests.support.certs import PASSWORD, USER, make_pki
from tests.unit.test_web_security import api_server


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_credential_flags(p)
    return p.parse_args(list(argv))


def test_flags_win_over_variables_and_the_password_comes_from_a_file_or_a_variable(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    creds = credentials_from(parse("--user", "a", "--password-file", str(pw)),
                             {"SLATRACE_USER": "b", "SLATRACE_PASSWORD": "from-env"})
    assert (creds.user, creds.password) == ("a", "from-file")
    creds = credentials_from(parse(), {"SLATRACE_USER": "b", "SLATRACE_PASSWORD": "from-env",
                                       "SLATRACE_CA_FILE": "/ca.pem"})
    assert (creds.user, creds.password, creds.ca_file) == ("b", "from-env", "/ca.pem")
    assert creds.authorization() == "Basic Yjpmcm9tLWVudg=="


@pytest.mark.parametrize("argv, env, says", [
    (("--user", "a"), {}, "--user a has no password: give --password-file FILE"),
    ((), {"SLATRACE_PASSWORD": "x"}, "a password is given but no user"),
    (("--cert-file", "c.pem"), {}, "needs both --cert-file and --key-file"),
    (("--user", "a", "--password-file", "/nonexistent"), {}, "cannot read the password file /nonexistent"),
])
def test_what_is_missing_is_one_sentence(argv, env, says):
    with pytest.raises(CredentialsError) as e:
        credentials_from(parse(*argv), env)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_each_refusal_of_a_protected_agent_names_its_fix(tmp_path):
    pki = make_pki(tmp_path / "pki")
    srv = api_server(WebAccess(str(pki.web_config(client_auth="VerifyClientCertIfGiven"))))
    agent = f"https://localhost:{srv.port}"
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD)
    try:
        for argv, says in (
                ((), "cannot verify the certificate of the agent at"),
                (("--ca-file", str(pki.ca)), "asks for credentials: give --user and --password-file"),
                (("--ca-file", str(pki.ca), "--user", "nobody", "--password-file", str(pw)),
                 "refused the credentials of user 'nobody'"),
        ):
            use_credentials(credentials_from(parse(*argv), {}))
            with pytest.raises(AgentUnreachable) as e:
                get(agent, "/api/v1/services")
            assert says in str(e.value), (argv, str(e.value))
        use_credentials(credentials_from(parse("--ca-file", str(pki.ca), "--user", USER, "--password-file", str(pw),
                                               "--cert-file", str(pki.client[0]), "--key-file", str(pki.client[1])),
                                         {}))
        assert get(agent, "/api/v1/services") == {"services": [{"name": "vllm"}]}
        with pytest.raises(AgentUnreachable, match="use an https:// URL"):
            get(f"http://localhost:{srv.port}", "/api/v1/services")
    finally:
        use_credentials(credentials_from(parse(), {}))
        srv.stop()
