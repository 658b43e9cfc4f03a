"""The Response object a job's record is."""

from __future__ import annotations

from chatq.core import response_object


def test_a_failed_responses_error_is_coded_as_openai_codes_it():
    refused = response_object.response_error({"type": "BadRequestError", "message": "bad schema", "code": 400})
    lost = response_object.response_error({"type": "InternalServerError", "message": "worker lost", "code": 500})
    assert refused == {"code": "invalid_prompt", "message": "bad schema"}
    assert lost == {"code": "server_error", "message": "worker lost"}
