"""What chatq reads from a Redis URL besides what redis-py does: its TLS options for kombu, Flower and the relay's
hand-written pub/sub connection, the URL with its password hidden, for whatever prints it, and a Sentinel URL
(`sentinel://`), from which every Redis client of chatq is made (sync_client, async_client, broker)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.retry as aioretry
import redis.asyncio.sentinel as aiosentinel
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff

# redis-py's names for the TLS query parameters of a rediss:// URL, which kombu and Flower take as they are.
TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
# The query parameters of a Sentinel URL: the sentinels' own login, when they want one.
SENTINEL_PARAMS = ("sentinel_username", "sentinel_password")
# Seconds a sentinel has to answer: one that is down must not hold up asking the next.
SENTINEL_TIMEOUT = 1.0


def masked(url: str) -> str:
    """The URL with its passwords (if any: Redis' and the sentinels') shown as `***`, the rest as given."""
    parts = urlsplit(url)
    login, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = login.partition(":")
    netloc = f"{user}:***@{hosts}" if at and colon else parts.netloc
    query = parse_qs(parts.query, keep_blank_values=True)
    if "sentinel_password" in query:
        shown = {k: "***" if k == "sentinel_password" else v[-1] for k, v in query.items()}
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(shown, safe="*")))
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class SentinelURL:
    """`sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db][?sentinel_password=...]`, parsed."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @property
    def login(self) -> dict[str, Any]:
        """The master's login and database, as redis-py's connections take them."""
        return {"db": self.db, "username": self.username, "password": self.password}

    @property
    def sentinel_kwargs(self) -> dict[str, Any]:
        """How redis-py connects to the sentinels themselves."""
        auth = {"username": self.sentinel_username, "password": self.sentinel_password}
        timeouts = {"socket_connect_timeout": SENTINEL_TIMEOUT, "socket_timeout": SENTINEL_TIMEOUT}
        return timeouts | {k: v for k, v in auth.items() if v is not None}


def sentinel_url(url: str) -> SentinelURL | None:
    """The URL's sentinels, master name and logins; None for a URL that names Redis itself (redis://, rediss://,
    unix://). ValueError for a sentinel:// URL without a master name or with something this form does not have."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    login, _, hosts = parts.netloc.rpartition("@")
    user, _, password = login.partition(":")
    names = [unquote(p) for p in parts.path.split("/") if p]
    if not names or len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError("a Sentinel URL ends in /<master-name> or /<master-name>/<db>")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if unknown := set(query) - set(SENTINEL_PARAMS):
        raise ValueError(f"a Sentinel URL takes no {', '.join(sorted(unknown))} parameter")
    return SentinelURL(
        sentinels=tuple(_host_port(h) for h in hosts.split(",")),
        master=names[0],
        db=int(names[1]) if len(names) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        sentinel_username=query.get("sentinel_username"),
        sentinel_password=query.get("sentinel_password"),
    )


def _host_port(address: str) -> tuple[str, int]:
    parts = urlsplit(f"//{address}")  # urllib reads a host, a bracketed IPv6 one and a port as in any URL
    if not parts.hostname:
        raise ValueError(f"a Sentinel URL lists a sentinel with no host: {address!r}")
    return parts.hostname, parts.port or SENTINEL_PORT


class _SyncBlockingSentinelPool(redis.sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """The master's connections, found through the sentinels, that a command waits for at the pool's size, as
    redis-py's BlockingConnectionPool does for a Redis it is given."""


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """_SyncBlockingSentinelPool's asyncio twin."""


def sync_client(url: str, blocking: bool = False, **options: Any) -> redis.Redis:
    """A redis-py client of the Redis the URL names; with a Sentinel URL, of its current master, found anew by each
    new connection, so a failover costs a reconnect. `blocking`: a full pool makes a command wait, not fail."""
    where = sentinel_url(url)
    if where is None and not blocking:
        return redis.Redis.from_url(url, **options)
    if where is None:
        return redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(url, **options))
    # A sentinel that fails is not asked again: the next one is.
    sentinel_kwargs = where.sentinel_kwargs | {"retry": redis.retry.Retry(NoBackoff(), 0)}
    sentinel = redis.sentinel.Sentinel(list(where.sentinels), sentinel_kwargs=sentinel_kwargs)
    pool = _SyncBlockingSentinelPool if blocking else redis.sentinel.SentinelConnectionPool
    return sentinel.master_for(where.master, connection_pool_class=pool, **where.login, **options)


def async_client(url: str, blocking: bool = False, **options: Any) -> aioredis.Redis:
    """sync_client's asyncio twin."""
    where = sentinel_url(url)
    if where is None and not blocking:
        return aioredis.Redis.from_url(url, **options)
    if where is None:
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, **options))
    sentinel = async_sentinel(where)
    pool = _BlockingSentinelPool if blocking else aiosentinel.SentinelConnectionPool
    return sentinel.master_for(where.master, connection_pool_class=pool, **where.login, **options)


def async_sentinel(where: SentinelURL) -> aiosentinel.Sentinel:
    sentinel_kwargs = where.sentinel_kwargs | {"retry": aioretry.Retry(NoBackoff(), 0)}
    return aiosentinel.Sentinel(list(where.sentinels), sentinel_kwargs=sentinel_kwargs)


def broker(url: str) -> tuple[str, dict[str, Any]]:
    """The URL as kombu (and Flower) take it, and the transport options it adds: kombu's own Sentinel form, one
    `sentinel://` URL per sentinel joined by `;`, each with the master's login, and the master's name apart."""
    where = sentinel_url(url)
    if where is None:
        return url, {}
    login = urlsplit(url).netloc.rpartition("@")[0]
    prefix = f"{SENTINEL_SCHEME}://{login}@" if login else f"{SENTINEL_SCHEME}://"
    hosts = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in where.sentinels]
    options = {"master_name": where.master, "sentinel_kwargs": where.sentinel_kwargs}
    return ";".join(f"{prefix}{h}/{where.db}" for h in hosts), options


def uses_tls(url: str) -> bool:
    return urlsplit(url).scheme == "rediss"


def broker_use_ssl(url: str) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` for a rediss:// URL (None for redis://): the URL's TLS parameters, certificates
    required unless it says otherwise, as redis-py reads the same URL."""
    if not uses_tls(url):
        return None
    query = {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items() if k in TLS_PARAMS}
    options: dict[str, Any] = {"ssl_cert_reqs": CERT_REQS.get(query.pop("ssl_cert_reqs", "required").lower())}
    if options["ssl_cert_reqs"] is None:
        raise ValueError("ssl_cert_reqs must be none, optional or required")
    if "ssl_check_hostname" in query:
        options["ssl_check_hostname"] = query.pop("ssl_check_hostname").lower() in ("1", "true", "yes", "on")
    options.update(query)
    return options


def ssl_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The client TLS context that redis-py would build from these parsed URL options (its `parse_url`'s)."""
    reqs = options.get("ssl_cert_reqs", "required")
    verify = CERT_REQS[reqs.lower()] if isinstance(reqs, str) else ssl.VerifyMode(reqs)
    context = ssl.create_default_context()
    context.check_hostname = bool(options.get("ssl_check_hostname", True)) and verify is not ssl.CERT_NONE
    context.verify_mode = verify
    if options.get("ssl_certfile") or options.get("ssl_keyfile"):
        context.load_cert_chain(certfile=options["ssl_certfile"], keyfile=options.get("ssl_keyfile"))
    if options.get("ssl_ca_certs"):
        context.load_verify_locations(cafile=options["ssl_ca_certs"])
    return context
