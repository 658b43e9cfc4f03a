"""A Redis URL's TLS options, as kombu and Flower take them, a Sentinel URL's parts, as redis-py and kombu take
them, and the URL as chatq prints it."""

from __future__ import annotations

import ssl

import pydantic
import pytest

from chatq.core.broker import SentinelTransport
from chatq.core.queue import PRIORITY_LANES, make_celery
from chatq.core.redis_url import SentinelURL, broker, broker_use_ssl, masked, sentinel_url
from chatq.core.settings import Settings


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


SENTINELS = "sentinel://:p%40ss@10.0.0.1:26379,10.0.0.2,[::1]:26380/chatq/2?sentinel_password=s3"


def test_a_sentinel_url_names_every_sentinel_the_master_its_database_and_both_logins() -> None:
    where = sentinel_url(SENTINELS)
    assert where == SentinelURL(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380)),
        master="chatq",
        db=2,
        password="p@ss",
        sentinel_password="s3",
    )
    assert where.login == {"db": 2, "username": None, "password": "p@ss"}
    assert where.sentinel_kwargs["password"] == "s3" and "username" not in where.sentinel_kwargs
    minimal = sentinel_url("sentinel://ops:pw@sentinel.example/mymaster")
    assert minimal is not None
    assert (minimal.sentinels, minimal.master, minimal.db, minimal.username) == (
        (("sentinel.example", 26379),),
        "mymaster",
        0,
        "ops",
    )
    assert "password" not in minimal.sentinel_kwargs  # the sentinels want no login unless the URL gives theirs


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://h/0", "unix:///run/redis.sock"])
def test_a_url_that_names_redis_itself_is_no_sentinel_url(url: str) -> None:
    assert sentinel_url(url) is None
    assert broker(url) == (url, {})


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("sentinel://h1,h2", "master-name"),
        ("sentinel://h1/chatq/zero", "master-name"),
        ("sentinel://h1/chatq/0/extra", "master-name"),
        ("sentinel://h1,,h2/chatq", "no host"),
        ("sentinel://h1/chatq?ssl_cert_reqs=none", "ssl_cert_reqs"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_when_the_settings_are_read(url: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        sentinel_url(url)
    with pytest.raises(pydantic.ValidationError, match=complaint):
        Settings(redis_url=url)


def test_kombu_gets_one_url_per_sentinel_each_with_the_masters_login_and_the_masters_name_apart() -> None:
    url, options = broker(SENTINELS)
    assert url == (
        "sentinel://:p%40ss@10.0.0.1:26379/2;sentinel://:p%40ss@10.0.0.2:26379/2;sentinel://:p%40ss@[::1]:26380/2"
    )
    assert options["master_name"] == "chatq" and options["sentinel_kwargs"]["password"] == "s3"
    app = make_celery(Settings(redis_url=SENTINELS))
    assert app.conf.broker_url == url
    assert app.conf.broker_transport_options["master_name"] == "chatq"
    # chatq's own options stay
    assert app.conf.broker_transport_options["priority_steps"] == list(range(PRIORITY_LANES))
    with app.connection_for_write() as conn:  # chatq's transport, over Sentinel, and every sentinel to fail over to
        assert isinstance(conn.transport, SentinelTransport)
        assert conn.alt == url.split(";")


def test_a_printed_sentinel_url_hides_both_passwords() -> None:
    shown = masked(SENTINELS)
    assert shown == "sentinel://:***@10.0.0.1:26379,10.0.0.2,[::1]:26380/chatq/2?sentinel_password=***"


def test_replicas_are_waited_for_by_default_only_behind_sentinels() -> None:
    assert Settings(redis_url=SENTINELS).wait_replicas == 1
    assert Settings(redis_url="redis://h/0").wait_replicas == 0
    assert Settings(redis_url="redis://h/0", redis_wait_replicas=2).wait_replicas == 2
    assert Settings(redis_url=SENTINELS, redis_wait_replicas=0).wait_replicas == 0
