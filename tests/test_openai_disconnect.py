"""A client that goes away mid-request frees its engine slot at once."""

from __future__ import annotations

import time

import httpx

STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]


def _num_active(server: str) -> int:
    return httpx.get(f"{server}/v1/engine/stats", timeout=10).json()["num_active"]


def _wait_idle(server: str, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (active := _num_active(server)) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return active


def test_stream_disconnect_frees_the_slot(server, served_model, openai_client) -> None:
    # No max_tokens and no EOS: it would run to the end of the context.
    body = {"model": served_model, "messages": STORY, "stream": True, "n": 2, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        contents = 0
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                contents += 1
                if contents >= 3:
                    break
        assert _num_active(server) == 2  # both choices are generating
    assert _wait_idle(server) == 0
    after = openai_client.chat.completions.create(model=served_model, messages=STORY, max_tokens=4)
    assert after.usage.completion_tokens == 4


def test_non_streamed_disconnect_frees_the_slot(server, served_model, openai_client) -> None:
    body = {"model": served_model, "messages": STORY, "ignore_eos": True}
    try:
        httpx.post(f"{server}/v1/chat/completions", json=body, timeout=2.0)
        raise AssertionError("a whole context of tokens on CPU cannot finish in 2 s")
    except httpx.ReadTimeout:
        pass  # httpx closes the connection
    assert _wait_idle(server) == 0
    after = openai_client.chat.completions.create(model=served_model, messages=STORY, max_tokens=4)
    assert after.usage.completion_tokens == 4
