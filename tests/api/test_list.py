"""GET /v1/chat/completions: the caller's own jobs, newest first or in creation order, a page at a time, as GET shows
each; never another key's, and neither deleted nor expired ones."""

from __future__ import annotations

import uuid

import httpx
import pytest

from chatq.core import keys
from tests.api.conftest import KEY_A, KEY_B, Guarded
from tests.helpers import assert_error, wait_for

M = [{"role": "user", "content": "Say hi."}]


def _job(http: httpx.Client, tag: str, wait: bool = False) -> str:
    """A background job of one token, cancelled unless `wait`: the guarded stack's queue holds three at most."""
    body = {"messages": M, "max_tokens": 1, "background": True, "request_id": f"{tag}-{uuid.uuid4().hex[:8]}"}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    if wait:
        wait_for(http, job_id, lambda j: j["status"] == "completed")
    else:
        assert http.post(f"/v1/chat/completions/{job_id}/cancel").status_code == 200
    return job_id


def _listed(http: httpx.Client, **params: str | int) -> dict:
    resp = http.get("/v1/chat/completions", params=params)
    assert resp.status_code == 200, resp.text
    page = resp.json()
    assert page["object"] == "list" and set(page) == {"object", "data", "first_id", "last_id", "has_more"}
    ids = [j["id"] for j in page["data"]]
    assert (page["first_id"], page["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))
    return page


def _all_ids(http: httpx.Client, **params: str | int) -> list[str]:
    """Every job of the caller's list, page by page."""
    ids: list[str] = []
    after: dict[str, str] = {}
    while True:
        page = _listed(http, limit=3, **params, **after)
        ids += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            return ids
        after = {"after": page["last_id"]}


def test_each_key_lists_its_own_jobs_newest_first_a_page_at_a_time(guarded: Guarded):
    with guarded.client(KEY_A) as a, guarded.client(KEY_B) as b:
        mine = [_job(a, "list-a", wait=i == 0) for i in range(5)]
        theirs = _job(b, "list-b")
        newest = _listed(a, limit=2, order="desc")
        assert [j["id"] for j in newest["data"]] == [mine[4], mine[3]] and newest["has_more"]
        after = _listed(a, limit=2, order="desc", after=newest["last_id"])
        assert [j["id"] for j in after["data"]] == [mine[2], mine[1]]

        every = _all_ids(a, order="desc")
        assert every[:5] == mine[::-1] and theirs not in every and len(every) == len(set(every))
        assert _all_ids(a) == every[::-1]  # asc, OpenAI's default: creation order
        assert _all_ids(b, order="desc")[0] == theirs and not set(mine) & set(_all_ids(b))

        # Each item is the job as GET shows it.
        [completed] = [j for j in _listed(a, limit=100)["data"] if j["id"] == mine[0]]
        assert completed == a.get(f"/v1/chat/completions/{mine[0]}").json()
        assert completed["status"] == "completed" and completed["choices"][0]["message"]["content"] is not None


def test_a_model_filter_and_the_default_page(guarded: Guarded):
    with guarded.client(KEY_A) as a:
        job_id = _job(a, "list-model")
        assert _listed(a, order="desc", model=guarded.settings.model_name)["data"][0]["id"] == job_id
        assert _listed(a, model="no-such-model")["data"] == []
        for _ in range(21 - len(_listed(a, limit=100)["data"])):
            _job(a, "list-page")
        page = _listed(a)
        assert len(page["data"]) == 20 and page["has_more"]


def test_deleted_and_expired_jobs_leave_the_list(guarded: Guarded):
    with guarded.client(KEY_A) as a:
        deleted, expired, kept = (_job(a, "list-gone") for _ in range(3))
        assert a.delete(f"/v1/chat/completions/{deleted}").status_code == 200
        guarded.r.delete(keys.job(expired))  # what its expiry does
        ids = [j["id"] for j in _listed(a, order="desc", limit=3)["data"]]
        assert kept in ids and deleted not in ids and expired not in ids
        owner_list = keys.owner_jobs(guarded.r.hget(keys.job(kept), "owner"))
        assert guarded.r.zscore(owner_list, expired) is None and guarded.r.zscore(owner_list, deleted) is None


@pytest.mark.parametrize(
    ("params", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order")],
)
def test_out_of_bounds_paging_is_a_400(guarded: Guarded, params: dict, param: str):
    with guarded.client(KEY_A) as a:
        assert_error(a.get("/v1/chat/completions", params=params), 400, "BadRequestError", param)


def test_paging_after_another_keys_job_is_a_404(guarded: Guarded):
    with guarded.client(KEY_A) as a, guarded.client(KEY_B) as b:
        theirs = _job(b, "list-after")
        assert_error(a.get("/v1/chat/completions", params={"after": theirs}), 404, "NotFoundError", "after")
        mine = _job(a, "list-after")
        assert mine not in [j["id"] for j in _listed(a, limit=100, order="desc", after=mine)["data"]]
