"""Multi-turn episodes made deterministic: tools, a scripted policy that calls them, and one SGD step on its
episodes (tests/test_agents.py; tests/helpers/distributed_update.py runs the step on two processes).

`ScriptedTurns` plays the policy: its turn k of an episode is a fixed text chosen by how many tool answers the
context holds, so each test knows which tokens the policy wrote and which the tools did."""

import json

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, turn_reward
from grpo.generation import Completions
from grpo.generation.episodes import CHATML_TOOLS_TEMPLATE
from grpo.testing import tiny_model, tiny_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# What the scripted policy writes at each turn (after 0, 1, 2 tool answers): two calls, then the answer.
SCRIPT = [call("add", a=2, b=3), call("multiply", a=5, b=5), "The answer is 25."]
ONE_CALL = [call("multiply", a=5, b=5), "It is 25."]
WRONG = ["The answer is 7."]


class ScriptedTurns:
    """A sampler that answers every context with script[k] + EOS, k = the tool answers already in the context. At the
    first turn row r of a call takes `scripts[(offset + r) % len(scripts)]` (`offset`: the global index of this
    process's first row), so the rows of a group can differ; later turns go on with the script whose first turn the
    context holds. `calls` records the prompt ids of every call, `limits` the `max_new_tokens` it was asked for (the
    turns are short enough never to need cutting)."""

    def __init__(self, tokenizer, scripts=(SCRIPT,), offset=0):
        self.tokenizer, self.scripts, self.offset = tokenizer, list(scripts), offset
        self.calls: list[list[list[int]]] = []
        self.limits: list[int | None] = []

    def sync_weights(self, model, version):
        pass

    def generate(self, model, prompt_ids, max_new_tokens=None):
        self.calls.append([list(p) for p in prompt_ids])
        self.limits.append(max_new_tokens)
        out = []
        for r, ids in enumerate(prompt_ids):
            context = self.tokenizer.decode(ids)
            answers = context.count("<tool_response>")
            if answers == 0:
                script = self.scripts[(self.offset + r) % len(self.scripts)]
            else:
                first_turn = context.split("<|im_start|>assistant")[1]
                script = next(s for s in self.scripts if s[0] in first_turn)
            turn = script[min(answers, len(script) - 1)]
            out.append(self.tokenizer(turn, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        return Completions(out)


def turn_starts(rollout, row: int) -> list[int]:
    """Where each policy turn of episode `row` starts in its completion: at 0, and after each tool answer."""
    sampled = rollout.sampled_mask[row].tolist()
    return [0] + [i for i in range(1, len(sampled)) if sampled[i] and not sampled[i - 1]]


def tool_tokenizer():
    """The tiny tokenizer with a chat template that renders tools."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def chat_prompts(n: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"row={i} What is (2 + 3) * 5?"}] for i in range(n)]}
    )


def reward_25(prompts, completions, **kwargs):
    return [float("25" in c[-1]["content"]) for c in completions]


@turn_reward
def tool_call_turns(completions, **kwargs):
    """A turn score for turn-level credit: 1 for each assistant turn that calls a tool, 0 for one that does not."""
    return [[float("tool_calls" in m) for m in c if m["role"] == "assistant"] for c in completions]


# One SGD step on episodes: G = 4, completions of up to three turns (byte tokens: long), prompts kept whole.
AGENT = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    num_generations=4,
    max_completion_length=400,
    max_prompt_length=None,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    max_steps=1,
    optim="sgd",
    learning_rate=0.5,
    max_grad_norm=0.0,
    shuffle_dataset=False,
)


def agent_step_update(output_dir, rewards=(reward_25,), **config):
    """(parameter update, trainer) after one plain-SGD step on the episodes of 4 prompts, whose rows take SCRIPT,
    ONE_CALL or WRONG (three, two or one policy turns) by global row index, scored by `rewards`. Rows 4-7 (the
    second process's in a two-process run of 4 rows each) never take SCRIPT: that process runs out of episodes a
    turn before the first, which must still generate with it (`lockstep`), and its episodes have fewer turns to
    score (turn-level credit)."""
    tokenizer = tool_tokenizer()
    args = GRPOConfig(output_dir=str(output_dir), **{**AGENT, **config})
    trainer = GRPOTrainer(
        tiny_model(tokenizer),
        list(rewards),
        args=args,
        train_dataset=chat_prompts(4),
        processing_class=tokenizer,
        tools=[add, multiply],
    )
    offset = trainer.accelerator.process_index * args.per_device_train_batch_size * args.steps_per_generation
    scripts = (SCRIPT, ONE_CALL, WRONG, SCRIPT, ONE_CALL, WRONG, ONE_CALL, WRONG)
    trainer.generation = ScriptedTurns(tokenizer, scripts, offset=offset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}, trainer


def save_talkative_model(path, tokenizer):
    """The tiny model (seed 0, as `save_tiny_model`) saved with `tokenizer` and a generation config in which every
    lowercase letter also ends a completion, so that its random turns end after a few tokens: multi-turn episodes
    with a model that never learned to stop (the vLLM tier)."""
    model = tiny_model(tokenizer)
    letters = tokenizer("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *letters]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def talkative_add_trainer(tmp_path, args: GRPOConfig) -> GRPOTrainer:
    """A trainer of `args` on episodes of three policy turns and two tool answers whatever the random model writes:
    the talkative tiny model (saved under `tmp_path`), 8 rows of two "Add i." conversations, the tool `add`, and
    `always_add` reading every turn as a call (with `max_tool_calling_iterations=2` in `args`)."""
    tokenizer = tool_tokenizer()
    path = save_talkative_model(tmp_path / "talkative", tokenizer)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Add {i}."}] for i in range(2)] * 4})
    trainer = GRPOTrainer(
        str(path), last_turn_length, args=args, train_dataset=data, processing_class=tokenizer, tools=[add]
    )
    trainer.agent.parser = always_add
    return trainer


def always_add(text, tool_names):
    """A tool-call parser that reads every turn as a call of `add(1, 2)` (the random model writes no JSON)."""
    from grpo.generation.tool_calls import ToolCall

    return [ToolCall("add", {"a": 1, "b": 2})]


def last_turn_length(prompts, completions, **kwargs):
    """A reward with a spread for random turns: the length of the episode's last policy turn."""
    return [float(len(c[-1]["content"])) for c in completions]


def again_agent(row, endpoint):
    """An agent program in plain HTTP (no client library): it asks, then says "Again." after the answer, so each
    episode is two calls that merge into one trained sequence (the vLLM tier's endpoint tests)."""
    import urllib.request

    messages, answers = list(row["prompt"]), []
    for _ in range(2):
        request = urllib.request.Request(
            endpoint.base_url + "/chat/completions",
            data=json.dumps({"messages": messages, "max_tokens": 6}).encode(),
            headers={"Authorization": f"Bearer {endpoint.api_key}"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            message = json.loads(response.read())["choices"][0]["message"]
        answers.append(message["content"])
        messages += [message, {"role": "user", "content": "Again."}]
    return {"answers": answers}


def talkative_agent_trainer(tmp_path, args: GRPOConfig) -> GRPOTrainer:
    """A trainer of `args` whose episodes are `again_agent`'s, on the talkative tiny model (saved under `tmp_path`)
    and 8 rows of two "Add i." conversations; the reward is the last answer's length (a spread for random turns)."""
    tokenizer = tool_tokenizer()
    path = save_talkative_model(tmp_path / "talkative", tokenizer)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Add {i}."}] for i in range(2)] * 4})
    return GRPOTrainer(
        str(path), answer_length, args=args, train_dataset=data, processing_class=tokenizer, agent_func=again_agent
    )


def answer_length(completions, answers, **kwargs):
    return [float(len(a[-1] or "")) for a in answers]
