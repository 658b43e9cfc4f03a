"""A managed key's record as Redis keeps it."""

from __future__ import annotations

from chatq.core.api_keys import SECRET_PREFIX, ApiKey, Limits, key_hash, new_secret, redacted


def test_a_record_reads_back_as_written_and_never_holds_the_secret():
    secret = new_secret()
    limits = Limits(rpm=5, tpm=None, models=("a", "b"))
    key = ApiKey("team-a", key_hash(secret), redacted(secret), 1_700_000_000, 1_800_000_000, limits)
    assert ApiKey.from_json(key.to_json()) == key
    assert secret not in key.to_json() and secret[len(SECRET_PREFIX) + 2 : -4] not in key.view()["redacted_value"]


def test_models_and_expiry():
    key = ApiKey("k", "h", "r", 0, 100, Limits(models=("a",)))
    assert key.allows("a") and not key.allows("b") and ApiKey("k", "h", "r", 0).allows("b")
    assert not key.expired(99.9) and key.expired(100) and not ApiKey("k", "h", "r", 0).expired(10**12)


def test_secrets_are_new_each_time():
    assert len({new_secret() for _ in range(100)}) == 100
