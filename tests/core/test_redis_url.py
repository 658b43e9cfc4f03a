"""A Redis URL's TLS options, as kombu and Flower take them, and the URL as chatq prints it."""

from __future__ import annotations

import ssl

import pytest

from chatq.core.redis_url import broker_use_ssl, masked


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@10.0.0.5:6380/0", "redis://:***@10.0.0.5:6380/0"),
        (
            "rediss://ops:hunter2@redis.example/1?ssl_cert_reqs=none",
            "rediss://ops:***@redis.example/1?ssl_cert_reqs=none",
        ),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_a_printed_url_hides_its_password_only(url: str, shown: str) -> None:
    assert masked(url) == shown


def test_rediss_urls_give_the_broker_their_tls_parameters_certificates_required_by_default() -> None:
    assert broker_use_ssl("redis://:pw@host:6379/0") is None
    assert broker_use_ssl("rediss://:pw@host:6379/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert broker_use_ssl("rediss://host/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem&ssl_check_hostname=false") == {
        "ssl_cert_reqs": ssl.CERT_NONE,
        "ssl_ca_certs": "/ca.pem",
        "ssl_check_hostname": False,
    }
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        broker_use_ssl("rediss://host/0?ssl_cert_reqs=sometimes")
