"""What an episode of three turns costs against one turn with the same tokens, and the same three turns written by an
agent program through the trainer's OpenAI-compatible endpoint: seconds per optimizer step, side by side in one
invocation (targets: three turns at most 1.3x one turn, issue 28; the endpoint at most 1.2x `tools=`, issue 48).

    python benchmarks/agent_turns.py                       # SmolLM2-135M-Instruct, float32 on the CPU
    python benchmarks/agent_turns.py --turn-tokens 48 --steps 3 --repeats 2

Every kind trains GRPO on the tool `add` (the same system prompt with the tool's schema), G completions of each of
2 prompts per step, beta 0.04, generation by the default backend (`model.generate`):
- `three-turns`: `tools=[add]`; every episode is three policy turns of `--turn-tokens` tokens each (a tool call, a
  tool call, the answer) and two tool answers in between (context tokens);
- `one-turn`: one policy turn of 3 x `--turn-tokens` tokens, its prompt longer by as many tokens as the tool answers
  take, so both kinds hold the same policy tokens and the same context tokens per row;
- `endpoint`: the three turns of `three-turns`, but the episode is an `openai`-client program (`agent_func`) that
  sends the chat, runs `add` itself and sends the chat again: the endpoint's HTTP requests, the batching of the
  episodes' requests and the merging of the calls into one trained row are what it adds.

So that every kind writes the same tokens, the scripted tokens are forced through `generation_kwargs`'s
`sequence_bias` (a GenerationConfig field: +100 on the script's next token after the context and the turn so far):
`model.generate` runs its ordinary passes (a prefill, then one forward per token with the KV cache) and the bias picks
the token. The difference between the kinds is then what the turn loop adds: the prefill of each later turn's new
tokens (each row's KV cache is carried across turns under `tools=`), the tool calls, and the loop itself; the training
forward and backward take the same tokens in all. Median seconds per step over the steps after the first, per kind;
the kinds alternate, each run in a fresh trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from transformers.utils import get_json_schema

from grpo import GRPOConfig, GRPOTrainer
from grpo.generation.episodes import CHATML_TOOLS_TEMPLATE, ToolTurnTokens
from grpo.models import smollm2_path

FILLER = " Let me think about it step by step."


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def exactly(tokenizer, text: str, length: int) -> list[int]:
    """Token ids of filler then `text` then EOS, `length` in all (the filler cut to fit)."""
    tail = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    filler = tokenizer(FILLER * length, add_special_tokens=False)["input_ids"]
    if len(tail) > length:
        raise SystemExit(f"--turn-tokens {length} is too short for {text!r} ({len(tail)} tokens)")
    return filler[: length - len(tail)] + tail


def forcing(turns: list[tuple[list[int], list[int]]]) -> dict[tuple[int, ...], float]:
    """`sequence_bias` entries that make `generate` write each turn's scripted tokens: for a turn (context tail,
    tokens), +100 on token i after the tail and tokens[:i]. The tail (the end of the context the turn follows, long
    enough to tell the turns apart) keeps the turns from matching each other's entries."""
    bias = {}
    for tail, tokens in turns:
        for i, token in enumerate(tokens):
            bias[tuple(tail + tokens[:i] + [token])] = 100.0
    return bias


def endpoint_agent(row, endpoint):
    """The three-turn episode as an agent program: ask, run every `add` the answer calls, ask again, until an answer
    calls nothing."""
    client = endpoint.client(max_retries=0)
    messages, schemas = list(row["prompt"]), [get_json_schema(add)]
    for _ in range(3):
        message = client.chat.completions.create(model=endpoint.model, messages=messages, tools=schemas)
        message = message.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    client.close()


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def run(kind: str, args) -> list[float]:
    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    t = args.turn_tokens
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d, "b": %d}}\n</tool_call>'
    question = "What is 1 + 2 + 4?"
    answer = ToolTurnTokens(tokenizer, [tokenizer.eos_token_id])
    answers = [answer([{"role": "tool", "name": "add", "content": str(n)}]) for n in (3, 7)]
    if kind == "one-turn":  # the prompt takes the context tokens of the two tool answers
        context = sum(len(a) for a in answers)
        question += tokenizer.decode(tokenizer(FILLER * context, add_special_tokens=False)["input_ids"][:context])
    prompt = [{"role": "user", "content": question}]
    prompt_ids = tokenizer.apply_chat_template(prompt, tools=[add], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_ids, add_special_tokens=False)["input_ids"]
    first_tail = prompt_ids[-len(answers[0]) :]
    if kind != "one-turn":
        turns = [
            (first_tail, exactly(tokenizer, call % (1, 2), t)),
            (answers[0], exactly(tokenizer, call % (3, 4), t)),
            (answers[1], exactly(tokenizer, "It is 7.", t)),
        ]
    else:
        turns = [(first_tail, exactly(tokenizer, "It is 7.", 3 * t))]
    data = Dataset.from_dict({"prompt": [prompt] * 2})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        report_to="none",
        num_generations=args.G,
        per_device_train_batch_size=2 * args.G,
        max_completion_length=3 * t + 200,
        max_prompt_length=None,
        max_tool_calling_iterations=2,
        generation_kwargs={"sequence_bias": forcing(turns)},
        beta=0.04,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )

    def correct(prompts, completions, **kwargs):
        return [float("7" in c[-1]["content"]) for c in completions]

    timer = StepTimes()
    episodes = {"agent_func": endpoint_agent} if kind == "endpoint" else {"tools": [add]}
    trainer = GRPOTrainer(
        path, correct, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[timer], **episodes
    )
    trainer.train()
    row = trainer.state.log_history[0]
    expected = sum(len(tokens) for _, tokens in turns)
    if row["completions/mean_length"] != expected:  # the forcing failed: the kinds would not compare like for like
        raise SystemExit(
            f"{kind}: {row['completions/mean_length']} policy tokens per row, not the script's {expected}"
        )
    print(f"  {kind}: policy tokens/row {row['completions/mean_length']:.0f}, turns {row['tools/turns']:.0f}, "
          f"s/step {', '.join(f'{x:.2f}' for x in timer.times)}", flush=True)  # fmt: skip
    return timer.times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turn-tokens", type=int, default=48, help="policy tokens per turn of the three-turn kind")
    parser.add_argument("--G", type=int, default=8, help="completions per prompt (2 prompts per step)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is not counted")
    parser.add_argument("--repeats", type=int, default=2, help="runs per kind, alternated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {"one-turn": [], "three-turns": [], "endpoint": []}
    for _ in range(args.repeats):
        for kind in times:
            times[kind] += run(kind, args)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    print(f"\n{'kind':<12} {'median s/step':>14} {'/ one-turn':>11} {'/ three-turns':>14}")
    for kind, value in medians.items():
        print(
            f"{kind:<12} {value:>14.2f} {value / medians['one-turn']:>11.2f} {value / medians['three-turns']:>14.2f}"
        )


if __name__ == "__main__":
    main()
