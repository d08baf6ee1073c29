"""A client written for vLLM's OpenAI-compatible server, in the style of vLLM's own examples
(examples/online_serving: the key "EMPTY", the API base on localhost:8000, a base64 image for a local
file, guided JSON through `response_format`, a system prompt and an earlier turn, a streamed answer).
tests/integration/test_openai.py runs it against mrc with only the three assignments below changed:
the key, the API base and the model.

Usage: python vllm_style_client.py IMAGE_PATH
"""

import base64
import json
import sys

from openai import OpenAI

# Modify OpenAI's API key and API base to use vLLM's API server.
openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"
model = "llava-hf/llava-1.5-7b-hf"

client = OpenAI(
    # defaults to os.environ.get("OPENAI_API_KEY")
    api_key=openai_api_key,
    base_url=openai_api_base,
)


def encode_base64_content_from_file(path: str) -> str:
    """Encode a local image to base64 format."""
    with open(path, "rb") as image_file:
        return base64.b64encode(image_file.read()).decode("utf-8")


def run_single_image(image_path: str, max_completion_tokens: int = 32) -> None:
    image_base64 = encode_base64_content_from_file(image_path)
    chat_completion_from_base64 = client.chat.completions.create(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What's in this image?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image_base64}"}},
                ],
            }
        ],
        model=model,
        max_completion_tokens=max_completion_tokens,
        temperature=0.0,
    )
    result = chat_completion_from_base64.choices[0].message.content
    print("Chat completion output:", result)
    print("Usage:", chat_completion_from_base64.usage)


def run_structured_output(image_path: str) -> None:
    schema = {
        "type": "object",
        "properties": {"damaged": {"type": "boolean"}},
        "required": ["damaged"],
        "additionalProperties": False,
    }
    image_base64 = encode_base64_content_from_file(image_path)
    completion = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Is the parcel damaged? Answer in JSON."},
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image_base64}"}},
                ],
            }
        ],
        response_format={"type": "json_schema", "json_schema": {"name": "damage", "schema": schema}},
        max_tokens=32,
    )
    print("Structured output:", json.loads(completion.choices[0].message.content))


def run_conversation(image_path: str) -> None:
    """A system prompt and an earlier turn, as vLLM's openai_chat_completion_client example sends them."""
    image_base64 = encode_base64_content_from_file(image_path)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image_base64}"}},
                {"type": "text", "text": "What colour is this parcel?"},
            ],
        },
        {"role": "assistant", "content": "It is brown."},
        {"role": "user", "content": "Is it damaged?"},
    ]
    chat_completion = client.chat.completions.create(
        messages=messages, model=model, max_tokens=16, temperature=0
    )
    print("Conversation output:", chat_completion.choices[0].message.content)


def run_streaming(image_path: str) -> None:
    """A system prompt and stream=True, as vLLM's multimodal chat example streams its answer."""
    image_base64 = encode_base64_content_from_file(image_path)
    chat_completion = client.chat.completions.create(
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What's in this image?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image_base64}"}},
                ],
            },
        ],
        model=model,
        max_completion_tokens=32,
        stream=True,
    )
    print("Streamed output: ", end="")
    for chunk in chat_completion:
        if chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    run_single_image(sys.argv[1])
    run_structured_output(sys.argv[1])
    run_conversation(sys.argv[1])
    run_streaming(sys.argv[1])
