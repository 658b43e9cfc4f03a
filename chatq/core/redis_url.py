"""What chatq reads from a Redis URL besides what redis-py does: its TLS options for kombu, Flower and the relay's
hand-written pub/sub connection, and the URL with its password hidden, for whatever prints it."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

# redis-py's names for the TLS query parameters of a rediss:// URL, which kombu and Flower take as they are.
TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def masked(url: str) -> str:
    """The URL with its password (if any) shown as `***`, the rest as given."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


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
