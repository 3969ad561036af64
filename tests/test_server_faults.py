"""Fault classification of what real servers answer (errors as HTTP statuses and inside 200 streams, rejected keys,
unknown models, missing endpoints), bounded waits from any Retry-After, and secrets kept out of messages."""
import asyncio
import time
from email.utils import formatdate

import httpx2
import pytest
from omegaconf import OmegaConf

from drafter_data.errors import StageError
from drafter_data.server.client import complete, make_client
from drafter_data.redaction import redact_url
from drafter_data.server.endpoints import ApiKey, api_key
from drafter_data.server.faults import MAX_RETRY_AFTER_S, Fault, RetryBudget, classify, retry_after_s
from drafter_data.server.request import RequestSpec

SPEC = RequestSpec(model="fake-model", max_tokens=64, temperature=0.0, top_p=1.0, seed=None, thinking=True,
                   thinking_kwarg="thinking")
LONG = [{"role": "user", "content": "one two three four five six seven eight nine ten"}]
SHORT = [{"role": "user", "content": "hello"}]


def fault_of(server, messages=SHORT, stream=True, key: str = "k", model: str = "fake-model") -> Fault:
    async def go():
        client = make_client(server.url, key, 2, 30)
        try:
            await complete(client, RequestSpec(**{**SPEC.__dict__, "model": model}), messages, stream=stream)
        except Exception as exc:  # noqa: BLE001 - the point
            return classify(exc)
        finally:
            await client.close()
        raise AssertionError("the request succeeded")

    return asyncio.run(go())


# --- 10.8: errors inside a 200 stream are classified by their code -------------------------------------------------

def test_a_context_error_inside_a_stream_is_permanent(fake_server):
    server = fake_server({"context_limit_words": 5, "context_error_in_stream": True})
    fault = fault_of(server, LONG)
    assert fault.kind == "permanent" and fault.answered
    assert "maximum context length" in fault.reason and "code 400" in fault.reason


def test_a_context_error_as_http_400_is_permanent(fake_server):
    server = fake_server({"context_limit_words": 5})
    assert fault_of(server, LONG).kind == "permanent"


def test_a_server_error_inside_a_stream_is_retried(fake_server):
    server = fake_server({"fault_rate": 1.0, "faults": ["stream_error"]})
    fault = fault_of(server)
    assert fault.kind == "retry" and "Internal server error" in fault.reason


# --- 10.4: run-wide faults -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("present", [True, False])
def test_a_rejected_key_is_run_wide_and_named_by_its_variable_never_its_value(fake_server, present):
    server = fake_server({"api_key": "the-right-key"})
    key = ApiKey("sk-wrong-value-123" if present else "EMPTY", "MY_SERVER_KEY", present)
    fault = fault_of(server, key=key)
    assert fault.kind == "run_wide" and "HTTP 401" in fault.reason and "MY_SERVER_KEY" in fault.reason
    assert ("was refused" if present else "is not set") in fault.reason
    assert "sk-wrong" not in fault.reason and "the-right-key" not in fault.reason


def test_an_unknown_model_is_run_wide_and_names_the_model(fake_server):
    server = fake_server({"check_model": True, "models": ["renamed-model"]})
    fault = fault_of(server, model="fake-model", stream=False)
    assert fault.kind == "run_wide" and "'fake-model'" in fault.reason and "does not exist" in fault.reason
    assert "server.model" in fault.reason


def test_a_missing_endpoint_is_run_wide(fake_server):
    server = fake_server({"chat_404": True})
    fault = fault_of(server)
    assert fault.kind == "run_wide" and "/v1/chat/completions is not served" in fault.reason


def test_run_wide_faults_give_up_at_once_in_a_budget():
    assert RetryBudget(8).next_wait(Fault("run_wide", "x")) is None


# --- 10.6: every wait is bounded -----------------------------------------------------------------------------------

def response(**headers) -> httpx2.Response:
    return httpx2.Response(429, headers=headers)


@pytest.mark.parametrize("headers,wish", [
    ({"retry-after": "2"}, 2.0),
    ({"retry-after": "0.5"}, 0.5),
    ({"retry-after-ms": "1500"}, 1.5),
    ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # the precise one wins
    ({"retry-after": "86400"}, MAX_RETRY_AFTER_S),
    ({"retry-after-ms": "1e12"}, MAX_RETRY_AFTER_S),
    ({"retry-after": "inf"}, None),
    ({"retry-after": "nan"}, None),
    ({"retry-after": "-5"}, None),
    ({"retry-after": "soon"}, None),
    ({"retry-after-ms": "infinity"}, None),
    ({"retry-after-ms": "garbage", "retry-after": "3"}, 3.0),
    ({}, None),
])
def test_retry_after_is_parsed_safely(headers, wish):
    assert retry_after_s(response(**headers)) == wish


def test_retry_after_as_an_http_date():
    wish = retry_after_s(response(**{"retry-after": formatdate(time.time() + 30, usegmt=True)}))
    assert 25 <= wish <= 31
    assert retry_after_s(response(**{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0


@pytest.mark.parametrize("wish", [86400.0, MAX_RETRY_AFTER_S, 1e300])
def test_a_budget_never_waits_longer_than_max_backoff(wish):
    budget = RetryBudget(8, max_backoff_s=2.0)
    assert all(0 <= budget.next_wait(Fault("retry", "429", retry_after_s=wish)) <= 2.0 for _ in range(7))


# --- 10.18: secrets never reach messages -----------------------------------------------------------------------

def test_redact_url_strips_user_and_password():
    assert redact_url("http://bob:hunter2@gpu-node:30000/v1") == "http://gpu-node:30000/v1"
    assert redact_url("see https://tok@h/v1 and http://h2/v1") == "see https://h/v1 and http://h2/v1"
    assert redact_url("http://gpu-node:30000/v1") == "http://gpu-node:30000/v1"


def test_fault_reasons_name_the_server_without_its_credentials():
    fault = Fault("retry", "HTTP 503").at("http://bob:hunter2@gpu-node:30000/v1")
    assert "hunter2" not in fault.reason and "gpu-node:30000" in fault.reason


@pytest.mark.parametrize("value", ["sk-proj-abc123", "sk_live_0123456789", "my key", "DRAFTER-API-KEY", "1ABC",
                                   "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2"])
def test_an_api_key_env_that_is_not_a_variable_name_is_refused_without_echoing_it(value):
    with pytest.raises(StageError) as err:
        api_key(OmegaConf.create({"api_key_env": value}))
    assert value not in str(err.value) and "server.api_key_env" in str(err.value)


def test_a_variable_name_gives_its_value_and_remembers_the_name(monkeypatch):
    monkeypatch.setenv("MY_SERVER_KEY", "the-value")
    key = api_key(OmegaConf.create({"api_key_env": "MY_SERVER_KEY"}))
    assert key == "the-value" and key.env_name == "MY_SERVER_KEY" and key.present
    monkeypatch.delenv("MY_SERVER_KEY")
    key = api_key(OmegaConf.create({"api_key_env": "MY_SERVER_KEY"}))
    assert key == "EMPTY" and not key.present


def test_redact_url_takes_the_parsers_userinfo_and_masks_secret_looking_query_values():
    """A password holding `@` (httpx accepts it) went out as `http://hunter3@host/v1`; api-key, x-api-key, auth and
    passwd query values were not masked."""
    assert redact_url("http://alice:hunter2@hunter3@host/v1") == "http://host/v1"
    text = redact_url("GET http://h:8000/v1/models?api-key=k1&x-api-key=k2&auth=k3&passwd=k4&model=m failed")
    assert text == "GET http://h:8000/v1/models?api-key=***&x-api-key=***&auth=***&passwd=***&model=m failed"
    assert not any(secret in redact_url("https://u:p@h/v1?token=t1;sig=s1&access_token=t2") for secret in
                   ("u:p", "t1", "s1", "t2"))
    assert redact_url("sqlite:////abs/mlflow.db") == "sqlite:////abs/mlflow.db"
