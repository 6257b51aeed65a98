"""`gym_sessions.client.tls`: ``verify=`` and ``cert=`` become one `ssl.SSLContext` per client."""

from __future__ import annotations

import ssl

import pytest

from gym_sessions.client.exchange import HTTPClientBase
from gym_sessions.client.tls import default_context, tls_context
from tests.tls import make_certificates

URL = "https://127.0.0.1:8443"


def test_http_urls_get_no_context_whatever_the_options():
    assert tls_context("http://h:1", verify=False, cert="/nowhere.pem") is None
    assert HTTPClientBase("http://h:1", ssl_context=default_context()).ssl_context is None


def test_the_default_is_one_shared_verifying_context():
    context = tls_context(URL)
    assert context is default_context() is HTTPClientBase(URL).ssl_context
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname


def test_verify_false_checks_nothing_and_leaves_the_default_alone():
    context = tls_context(URL, verify=False)
    assert context is not default_context()
    assert context.verify_mode is ssl.CERT_NONE and not context.check_hostname
    assert default_context().verify_mode is ssl.CERT_REQUIRED


def test_a_ca_file_directory_and_client_certificates_load(tmp_path):
    certificates = make_certificates(str(tmp_path))
    context = tls_context(URL, verify=certificates.ca)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert [c["subject"] for c in context.get_ca_certs()] == [
        ((("commonName", "gym-sessions test CA"),),)
    ]
    assert tls_context(URL, verify=str(tmp_path)).verify_mode is ssl.CERT_REQUIRED
    tls_context(URL, cert=(certificates.client_cert, certificates.client_key))
    tls_context(URL, cert=certificates.client_combined)
    with pytest.raises(ssl.SSLError):
        tls_context(URL, cert=certificates.client_cert)  # no key in that file
    with pytest.raises(FileNotFoundError):
        tls_context(URL, verify=str(tmp_path / "missing.pem"))


def test_an_ssl_context_is_used_as_it_is_and_takes_no_cert():
    own = ssl.create_default_context()
    assert tls_context(URL, verify=own) is own
    with pytest.raises(ValueError, match="cert="):
        tls_context(URL, verify=own, cert="client.pem")
