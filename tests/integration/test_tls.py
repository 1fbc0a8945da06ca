"""The process's one TLS context (decision 263): a real HTTPS server on loopback, certificates from a test
CA (trustme), trust stores laid out as OpenSSL reads them (`openssl rehash`)."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import trustme

from billingctl.adapters import tls
from billingctl.bootstrap import Container
from billingctl.settings import Settings

pytestmark = pytest.mark.integration


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def authority():
    return trustme.CA()


@pytest.fixture(scope="module")
def https_url(authority):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    authority.issue_cert("localhost").configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://localhost:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _hashed_store(directory: Path, *authorities: trustme.CA) -> str:
    directory.mkdir()
    for number, ca in enumerate(authorities):
        ca.cert_pem.write_to_path(str(directory / f"ca{number}.pem"))
    subprocess.run(["openssl", "rehash", str(directory)], check=True, capture_output=True)
    return str(directory)


def test_a_hashed_directory_is_read_lazily_one_certificate_a_chain(tmp_path, authority, https_url):
    store = _hashed_store(tmp_path / "certs", trustme.CA(), authority, trustme.CA())
    chosen = tls.trust_store(environ={}, system_capath=store)
    assert chosen == {"capath": store}
    context = ssl.create_default_context(**chosen)
    assert context.cert_store_stats()["x509_ca"] == 0  # nothing parsed before a handshake needs it
    with httpx.Client(verify=context) as client:
        assert client.get(https_url).text == "ok"
    assert context.cert_store_stats()["x509_ca"] == 1  # the one root the server's chain needed
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_server_the_trust_store_does_not_vouch_for_is_refused(tmp_path, https_url):
    store = _hashed_store(tmp_path / "certs", trustme.CA())
    context = ssl.create_default_context(**tls.trust_store(environ={}, system_capath=store))
    with httpx.Client(verify=context) as client, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        client.get(https_url)


def test_an_operators_trust_store_comes_first_and_certifi_last(tmp_path, authority):
    import certifi

    hashed = _hashed_store(tmp_path / "certs", authority)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "bundle.pem").write_text("")
    assert tls.trust_store(environ={"SSL_CERT_FILE": "/x.pem", "SSL_CERT_DIR": hashed},
                           system_capath=hashed) == {"cafile": "/x.pem"}
    assert tls.trust_store(environ={"SSL_CERT_DIR": "/ops"}, system_capath=hashed) == {"capath": "/ops"}
    # A directory without OpenSSL's hash names finds nothing: certifi's bundle, as httpx would load.
    assert tls.trust_store(environ={}, system_capath=str(plain)) == {"cafile": certifi.where()}
    assert tls.trust_store(environ={}, system_capath=str(tmp_path / "missing")) == {"cafile": certifi.where()}


def test_every_outbound_client_of_a_process_shares_the_one_context(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'b.db'}", provider_url="https://provider.invalid",
                        orchestrator_url="https://orchestrator.invalid", provider_api_key="k",
                        orchestrator_api_key="k")
    container = Container(settings)
    contexts = {id(client.http.client._transport._pool._ssl_context)
                for client in (container.provider, container.orchestrator)}
    assert contexts == {id(tls.context())}
