"""The two client libraries most often put in front of an OpenAI-compatible server, langchain-openai and litellm,
against a real `edgeinfer serve` (default model): text, streaming, tools, structured output, /v1/responses and the
error classes they map our 4xx onto."""

from __future__ import annotations

import asyncio
import os

import openai
import pytest
from pydantic import BaseModel

from tests.gateway.conftest import DEMO_KEY

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")    # litellm fetches its price list on import otherwise

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # e2e: claims through the public API (a real stack)
MODEL = "SmolLM2-135M-Instruct"
# "Answer in one sentence.": the bare question is a near-tie on this model ("The" 25.328 vs "L" 25.300 in logits
# with fp32 KV), which int8 KV's rounding tips into French (docs/QUANTIZATION.md); the README asks the same
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def base_url(compat_serve):
    return f"http://127.0.0.1:{compat_serve.port}/v1"


# --- langchain-openai -----------------------------------------------------------------------------------------

def chat_model(base_url, **kw):
    from langchain_openai import ChatOpenAI

    kw = {"temperature": 0, "max_tokens": 48, "api_key": DEMO_KEY, **kw}
    return ChatOpenAI(model=MODEL, base_url=base_url, max_retries=0, **kw)


def test_langchain_invoke_and_stream(base_url):
    m = chat_model(base_url)
    r = m.invoke(QUESTION)
    assert "Paris" in r.content and r.response_metadata["finish_reason"] == "stop"
    assert r.usage_metadata["input_tokens"] > 0 and r.usage_metadata["output_tokens"] > 0
    assert "".join(c.content for c in m.stream(QUESTION)) == r.content


def test_langchain_bind_tools_any_gets_the_call(base_url):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        return "sunny"

    # strict: the arguments' schema closed (additionalProperties false), as clients asking for exact arguments send
    # it; an open schema lets the 135M model ramble in extra keys past max_tokens (it did under fp8 KV's rounding)
    r = chat_model(base_url).bind_tools([get_weather], tool_choice="any", strict=True).invoke(
        "What's the weather in Paris?")
    assert [c["name"] for c in r.tool_calls] == ["get_weather"] and "city" in r.tool_calls[0]["args"]
    assert "tool_call" not in r.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(base_url, method):
    city = chat_model(base_url, max_tokens=96).with_structured_output(City, method=method).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name == "Paris"


def test_langchain_responses_api(base_url):
    r = chat_model(base_url, use_responses_api=True, max_tokens=24).invoke(QUESTION)
    assert "Paris" in r.text


def test_langchain_sees_openais_error_classes(base_url):
    with pytest.raises(openai.AuthenticationError):
        chat_model(base_url, api_key="sk-wrong").invoke(QUESTION)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat_model(base_url, temperature=9).invoke(QUESTION)


# --- litellm --------------------------------------------------------------------------------------------------

def lite(base_url, **kw):
    return {"model": f"openai/{MODEL}", "api_base": base_url, "api_key": DEMO_KEY, "temperature": 0,
            "max_tokens": 48, **kw}


def test_litellm_completion_stream_and_async(base_url):
    import litellm

    msgs = [{"role": "user", "content": QUESTION}]
    r = litellm.completion(messages=msgs, **lite(base_url))
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       litellm.completion(messages=msgs, stream=True, **lite(base_url)))
    assert streamed == text
    assert asyncio.run(litellm.acompletion(messages=msgs, **lite(base_url))).choices[0].message.content == text
    t = litellm.text_completion(prompt="The capital of France is", **lite(base_url, max_tokens=4))
    assert "Paris" in t.choices[0].text


def test_litellm_tools_and_structured_output(base_url):
    import litellm

    r = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                           tool_choice="required", parallel_tool_calls=False, **lite(base_url))
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    r = litellm.completion(messages=[{"role": "user", "content": "Describe Paris."}], response_format=City,
                           **lite(base_url, max_tokens=96))
    assert City.model_validate_json(r.choices[0].message.content).name == "Paris"


def test_litellm_responses(base_url):
    import litellm

    r = litellm.responses(input=QUESTION, model=f"openai/{MODEL}", api_base=base_url, api_key=DEMO_KEY,
                          temperature=0, max_output_tokens=24)
    assert "Paris" in r.output_text


def test_litellm_maps_our_errors_onto_its_classes(base_url):
    import litellm

    msgs = [{"role": "user", "content": QUESTION}]
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(messages=msgs, **lite(base_url, api_key="sk-wrong"))
    with pytest.raises(litellm.BadRequestError, match="temperature"):
        litellm.completion(messages=msgs, **lite(base_url, temperature=9))
