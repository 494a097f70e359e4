"""The openai-agents SDK on its default model path (the Responses API) against `bentoml serve`:
an agent with one function tool and a structured output type."""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel, Field

agents = pytest.importorskip("agents")


class WeatherReport(BaseModel):
    city: str = Field(max_length=20)
    weather: str = Field(max_length=30)


def test_agent_with_a_function_tool_and_an_output_type(server, served_model) -> None:
    calls: list[str] = []

    # Offered until called once: a 135M model would otherwise call it turn after turn.
    @agents.function_tool(is_enabled=lambda context, agent: not calls)
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return "sunny, 21 C"

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    agent = agents.Agent(
        name="weather", instructions="Look up the weather with the tool, then report it.", model=served_model,
        tools=[get_weather], output_type=WeatherReport,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                            parallel_tool_calls=False))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, WeatherReport)
