#!/usr/bin/env python3
"""The `openai` Python package against `rloo serve`, unchanged: model list,
chat and text completions, whole and streamed, n > 1, log-probs, a seed,
and the errors it raises. Outside CI (it needs `pip install openai`).

    rloo serve --model chat=tests/fixtures/models/qwen3-causal \
               --model text=tests/fixtures/models/gpt_neox-causal --port 8000 &
    python3 scripts/serve/openai_check.py http://127.0.0.1:8000/v1
"""

import sys

import openai
from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key=sys.argv[2] if len(sys.argv) > 2 else "unused")

models = [m.id for m in client.models.list()]
print("models:", models)
assert {"chat", "text"} <= set(models), models

messages = [{"role": "user", "content": "Say something nice."}]
chat = client.chat.completions.create(model="chat", messages=messages, max_tokens=12, temperature=0)
print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason, chat.usage)
assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
assert chat.usage.completion_tokens <= 12

pieces = []
for chunk in client.chat.completions.create(model="chat", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
    for choice in chunk.choices:
        pieces.append(choice.delta.content or "")
    if chunk.usage:
        print("streamed usage:", chunk.usage)
print("streamed:", repr("".join(pieces)), f"({len(pieces)} chunks)")
assert "".join(pieces) == chat.choices[0].message.content

sampled = client.chat.completions.create(model="chat", messages=messages, max_tokens=8, temperature=1.0, n=3, seed=5,
                                         logprobs=True, top_logprobs=2)
again = client.chat.completions.create(model="chat", messages=messages, max_tokens=8, temperature=1.0, n=3, seed=5,
                                       logprobs=True, top_logprobs=2)
texts = [c.message.content for c in sampled.choices]
print("n=3, seed 5:", texts)
assert texts == [c.message.content for c in again.choices]
first = sampled.choices[0].logprobs.content[0]
print("first token:", repr(first.token), first.logprob, [(t.token, t.logprob) for t in first.top_logprobs])

text = client.completions.create(model="text", prompt=["Once upon a time", "The weather"], max_tokens=10,
                                 temperature=0, logprobs=2)
for c in text.choices:
    print(f"completion {c.index}:", repr(c.text), c.finish_reason, c.logprobs.tokens[:3])
assert [c.index for c in text.choices] == [0, 1]

streamed = "".join(c.choices[0].text for c in client.completions.create(
    model="text", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True) if c.choices)
assert streamed == text.choices[0].text, (streamed, text.choices[0].text)

for bad in [dict(model="nope"), dict(model="text", max_tokens=100000)]:
    try:
        client.completions.create(prompt="x", **{"max_tokens": 4, **bad})
        raise AssertionError("should have failed")
    except openai.APIStatusError as e:
        print(f"{type(e).__name__} {e.status_code}: {e.message}")
print("the openai client works unchanged")
