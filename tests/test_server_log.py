"""The request log: one line a request, naming the reason of every error and counting the tokens
of a stream the client cut off (logged as 499). And one wording per error, from Python and over
HTTP."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from radixlm.protocol.sampling_params import SamplingParams
from radixlm.server.app import create_app
from tests.live_server import serve_in_thread, wait_idle

API_KEY = "log-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LINE = re.compile(
    r"^(?P<id>[0-9a-f]{12}) (?P<method>\S+) (?P<path>\S+) (?P<code>\d{3}) "
    r"in=(?P<prompt>\d+) out=(?P<completion>\d+) cached=\d+ [0-9.]+s(?:: (?P<reason>.*))?$"
)


def logged(caplog: pytest.LogCaptureFixture, path: str) -> list[re.Match[str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "radixlm.server"]
    found = [m for m in map(LINE.match, lines) if m is not None and m["path"] == path]
    return found


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, api_key=API_KEY, owns_engine=False)) as c:
        yield c


def test_an_error_is_logged_with_the_reason_the_client_was_given(client, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.server")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": -1}}
    r = client.post("/generate", json=body, headers=AUTH)
    assert r.status_code == 400
    (line,) = logged(caplog, "/generate")
    assert line["code"] == "400" and line["reason"] == r.json()["error"]["message"]

    assert client.get("/v1/models").status_code == 401  # no key
    (line,) = logged(caplog, "/v1/models")
    assert line["code"] == "401" and line["reason"].startswith("missing or wrong API key")

    assert client.get("/no-such-route", headers=AUTH).status_code == 404
    assert logged(caplog, "/no-such-route")[0]["reason"] == "Not Found"


def test_a_success_is_logged_without_a_reason(client, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.server")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert client.post("/generate", json=body, headers=AUTH).status_code == 200
    (line,) = logged(caplog, "/generate")
    assert line["code"] == "200" and line["reason"] is None and line["completion"] == "2"


def test_a_bad_value_reads_the_same_from_python_and_over_http(client):
    with pytest.raises(ValueError) as python:
        SamplingParams.from_dict({"max_new_tokens": -1})
    body = {"text": "hi", "sampling_params": {"max_new_tokens": -1}}
    http = client.post("/generate", json=body, headers=AUTH).json()["error"]["message"]
    assert "max_new_tokens=-1 must be >= 0" in str(python.value)
    assert "max_new_tokens=-1 must be >= 0" in http

    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        SamplingParams.from_dict({"ignore_eos": "yes"})
    body = {"text": "hi", "stream": "yes"}
    http = client.post("/generate", json=body, headers=AUTH).json()["error"]["message"]
    assert http == "stream must be true or false"


def test_a_stream_the_client_cuts_off_is_logged_as_499_with_the_tokens_it_got(engine, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.server")
    params = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
    body = {"text": "Count to a million:", "sampling_params": params, "stream": True}
    with serve_in_thread(engine, API_KEY) as url:
        wait_idle(engine.get_stats, 10.0)
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", url + "/generate", json=body, headers=AUTH) as r,
        ):
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got = json.loads(line[6:])["meta_info"]["completion_tokens"]
                    if got >= 3:
                        break
            lines.close()
        wait_idle(engine.get_stats, 10.0)  # aborted: its line is written as it ends
        found = []
        for _ in range(100):
            found = logged(caplog, "/generate")
            if found:
                break
            time.sleep(0.05)
    (line,) = found
    assert line["code"] == "499"
    assert "closed the connection during the response" in line["reason"]
    assert got <= int(line["completion"]) < 2000  # what was sent, not 0
    assert int(line["prompt"]) > 0
