"""The calculator agent of examples/recipes/agent_calculator_openai.yaml, written as an ordinary program that calls
a chat API with the `openai` client and runs its own tool, with nothing of grpo in it: the trainer gives it a base
URL and a key (`endpoint`), and trains on the exact tokens its calls sampled (docs/agents.md, "Any agent").

The same task as `make demo-agent` (agent_calculator.yaml, which gives the trainer the tool with `tools=`): one call
of `multiply` may be made, then the answer. The reward is the same function, `agent_calculator:final_answer`, on the
episode's messages.
"""

import json

from openai import OpenAI

# The tool as an OpenAI function schema, written by hand (the schema `tools=` derives from the docstring of
# agent_calculator.multiply, so that both demos show the model the same prompt).
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "the first integer"},
                "b": {"type": "integer", "description": "the second integer"},
            },
            "required": ["a", "b"],
        },
        "return": {"type": "integer"},
    },
}


def run_multiply(arguments: str) -> str:
    """The tool: the product of the call's `a` and `b`, or the error as text (the model sees it and goes on)."""
    try:
        values = json.loads(arguments)
        return str(int(values["a"]) * int(values["b"]))
    except Exception as error:  # noqa: BLE001 (any bad call is an answer the model reads)
        return f"Error: {type(error).__name__}: {error}"


def solve(row, endpoint):
    """One episode: ask, run the one `multiply` call the model may make, ask again, and return the reply."""
    client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = list(row["prompt"])
    reply = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[MULTIPLY])
    message = reply.choices[0].message
    if message.tool_calls and reply.choices[0].finish_reason != "length":
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_multiply(call.function.arguments)}
            )
        message = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[MULTIPLY])
        message = message.choices[0].message
    client.close()
    return {"reply": message.content or ""}
