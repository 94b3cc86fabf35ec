"""Built-in reward functions. Each follows the reward-function contract of docs/rewards.md: keyword arguments in,
one number (or None, "not applicable") per row out. The examples in the docstrings run as tests.

    from grpo.rewards import accuracy, format_reward, soft_overlong_punishment, code_execution, reasoning_gym

    trainer = GRPOTrainer(model, [accuracy, format_reward()], args=GRPOConfig(reward_weights=[1.0, 0.2], ...), ...)

Plain functions (`accuracy`, `reasoning_gym`) are used as they are; the others are built by calling them with their
settings (`format_reward(pattern)`, `soft_overlong_punishment(max_len, cache)`, `code_execution(limits)`).
Completions may be strings or chat messages (the last message's content is scored).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

from grpo.data import completion_text
from grpo.generation.call_scope import run_in_context

# ---- accuracy ----


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None.

    >>> last_boxed(r"so \\boxed{1} or rather \\boxed{\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


_NUMBER = r"-?\\d?frac\{-?[\d.,]+\}\{-?[\d.,]+\}|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?"


def _normalise(text: str) -> str:
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    for junk in ("$", "\\!", "\\,", "\\;", "\\left", "\\right", "^\\circ", "^{\\circ}", "\\%", "%"):
        text = text.replace(junk, "")
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def _as_number(text: str) -> Fraction | None:
    text = _normalise(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):  # thousands separators
        text = text.replace(",", "")
    frac = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        return Fraction(text)  # integers, decimals, a/b
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, gold: str) -> bool:
    """The comparison `accuracy` uses without math-verify: equal as numbers (fractions, decimals, thousands
    separators and LaTeX `\\frac` understood), else equal as strings after normalisation (spaces, `$`, `\\text{}`,
    case and a final period removed).

    >>> answers_match("1,234", "1234"), answers_match("\\\\frac{1}{2}", "0.5"), answers_match("x+1", "X + 1")
    (True, True, True)
    """
    a, b = _as_number(predicted), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    return _normalise(predicted) == _normalise(gold)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, without math-verify: the last `\\boxed{}`, else the content of the last
    `<answer>` tags, else the last number.

    >>> extract_answer("3 + 4 = 7, so 7 * 2 = 14."), extract_answer(r"Thus \\boxed{\\frac{1}{2}}")
    ('14', '\\\\frac{1}{2}')
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def accuracy(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the row's `answer` column mathematically, else 0.0; None for
    rows whose `answer` is None (or, with math-verify, cannot be parsed). Uses math-verify when installed
    (`pip install grpo[math]`: LaTeX, sets, intervals, symbolic equality), else `extract_answer` and
    `answers_match`. A gold answer in GSM8K form ("... #### 72") is cut to the part after "####".

    >>> accuracy(["The total is \\\\boxed{1,234}.", "I think 5/10", "It is 7."], answer=["1234", "\\\\frac{1}{2}", 8])
    [1.0, 1.0, 0.0]
    """
    mv = _math_verify()
    # math-verify's timeouts use signal.alarm, which works only in the main thread.
    timeouts = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    rewards = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            rewards.append(None)
            continue
        gold, text = str(gold).split("####")[-1].strip(), completion_text(completion)
        if mv is not None:
            gold_parsed = mv.parse(gold if "\\boxed" in gold or "$" in gold else f"${gold}$", **timeouts)
            if not gold_parsed:
                rewards.append(None)
                continue
            verify_timeout = {} if not timeouts else {"timeout_seconds": None}
            rewards.append(float(mv.verify(gold_parsed, mv.parse(text, **timeouts), **verify_timeout)))
        else:
            predicted = extract_answer(text)
            rewards.append(float(predicted is not None and answers_match(predicted, gold)))
    return rewards


# ---- format ----

THINK_ANSWER = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def format_reward(pattern: str | re.Pattern = THINK_ANSWER) -> Callable:
    """A reward named `format`: 1.0 when the whole completion matches `pattern` (a regular expression; `.`
    matches newlines), else 0.0. The default asks for `<think>...</think>` then `<answer>...</answer>`.

    >>> format_reward()(["<think>2+2</think> <answer>4</answer>", "4"])
    [1.0, 0.0]
    >>> format_reward(r".*\\\\boxed\\{.+\\}.*")(["so \\\\boxed{4}", "so 4"])
    [1.0, 0.0]
    """
    compiled = re.compile(pattern, flags=re.DOTALL) if isinstance(pattern, str) else pattern

    def format(completions, **kwargs) -> list[float]:
        return [1.0 if compiled.fullmatch(completion_text(c)) else 0.0 for c in completions]

    return format


# ---- soft overlong punishment ----


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """DAPO's length penalty (arXiv:2503.14476, eq. 13), on completion tokens L, with L_max = `max_completion_len`
    and L_cache = `soft_punish_cache`:

        0                                   if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (from 0 down to -1)
        -1                                  if L > L_max

    Add it to the task reward (DAPO used L_max = 20480, L_cache = 4096, with max_completion_length = L_max).

    >>> penalty = soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    >>> penalty(completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 12])
    [0.0, -0.5, -1.0, -1.0]
    """
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(
            f"soft_punish_cache={soft_punish_cache} must be in (0, max_completion_len={max_completion_len}]: it is "
            "the length of the band before the maximum in which the penalty grows from 0 to -1."
        )
    start = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completion_ids, **kwargs) -> list[float]:
        return [
            0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / soft_punish_cache) for ids in completion_ids
        ]

    return soft_overlong_punishment


# ---- reasoning-gym ----


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable:
    try:
        import reasoning_gym as rg
    except ImportError as e:
        raise ImportError("The reasoning_gym reward needs reasoning-gym: pip install 'grpo[tasks]'.") from e
    return rg.get_score_answer_fn(name)


def reasoning_gym_dataset(name: str, size: int, seed: int = 0, **task_config):
    """A `datasets.Dataset` of a reasoning-gym task, generated offline: columns `prompt` (the question),
    `question`, `answer` and `metadata` (JSON text, since its fields differ between tasks), ready for the
    `reasoning_gym` reward.

    >>> ds = reasoning_gym_dataset("basic_arithmetic", size=2, seed=1)
    >>> ds.column_names, ds[0]["prompt"]
    (['prompt', 'question', 'answer', 'metadata'], 'Calculate 5 - 3 - 6.')
    """
    import reasoning_gym as rg
    from datasets import Dataset

    items = list(rg.create_dataset(name, size=size, seed=seed, **task_config))
    return Dataset.from_dict(
        {
            "prompt": [item["question"] for item in items],
            "question": [item["question"] for item in items],
            "answer": [item["answer"] for item in items],
            "metadata": [json.dumps(item["metadata"], default=list) for item in items],
        }
    )


def reasoning_gym(completions, metadata, answer, question=None, **kwargs) -> list[float | None]:
    """The score of a reasoning-gym task's own scorer (usually 0 to 1), chosen per row by its
    `metadata["source_dataset"]`, on the content of the completion's last `<answer>` tags (the whole completion
    when it has none). Needs the `metadata` and `answer` columns (`question` too, for the few tasks that read it),
    as `reasoning_gym_dataset` makes them; None for rows without metadata.

    >>> ds = reasoning_gym_dataset("basic_arithmetic", size=2, seed=1)  # answers "-4" and ...
    >>> reasoning_gym(["<answer>-4</answer>", "<answer>0</answer>"], metadata=ds["metadata"], answer=ds["answer"])
    [1.0, 0.0]
    """
    questions = question if question is not None else [None] * len(completions)
    rewards = []
    for completion, meta, gold, q in zip(completions, metadata, answer, questions):
        if meta is None:
            rewards.append(None)
            continue
        meta = json.loads(meta) if isinstance(meta, str) else meta
        text = completion_text(completion)
        tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
        predicted = tagged[-1].strip() if tagged else text.strip()
        entry = {"question": q, "answer": gold, "metadata": meta}
        rewards.append(float(_reasoning_gym_scorer(meta["source_dataset"])(answer=predicted, entry=entry)))
    return rewards


# ---- code execution ----


def extract_code(text: str) -> str:
    """The last fenced code block (```python or ```), or the whole text when there is none.

    >>> extract_code("Here:\\n```python\\nprint(1)\\n```\\nDone.")
    'print(1)\\n'
    """
    blocks = re.findall(r"```(?:python|py|python3)?[^\n]*\n(.*?)```", text, flags=re.DOTALL)
    return blocks[-1] if blocks else text


_TESTS_WARNING = (
    "code_execution scores rows by their `tests` snippets, which run in the process that ran the code: the code can "
    "make them pass (an always-equal __eq__, a forged count), and a policy can learn that. For training, give a "
    "`cases` column ({'call': ..., 'expected': ...} or {'stdin': ..., 'stdout': ...} per case), whose verdict is "
    "computed outside the sandbox (docs/rewards.md#safe-code-execution)."
)


def _code_checks(i: int, row_tests, row_cases) -> tuple[str, list] | None:
    """("cases", the checked cases), ("tests", the snippets) or None (nothing to score) for row `i` of
    `code_execution`; a row with both, or with malformed cases, is a ValueError naming the row."""
    from grpo.rewards.sandbox import check_cases

    if row_cases is not None and not isinstance(row_cases, str) and not row_cases:
        row_cases = None  # an empty list
    row_tests = [row_tests] if isinstance(row_tests, str) else list(row_tests or [])
    if row_cases is not None and row_tests:
        raise ValueError(
            f"code_execution: row {i} has both `cases` and `tests`; it scores one of them. Drop the `tests` column "
            "(cases cannot be faked by the code: docs/rewards.md#safe-code-execution)."
        )
    if row_cases is None:
        return ("tests", row_tests) if row_tests else None
    try:
        row_cases = check_cases(row_cases)
    except ValueError as e:
        raise ValueError(f"code_execution: row {i}: {e}") from None
    return ("cases", row_cases) if row_cases else None


def code_execution(
    wall_seconds: float = 10.0,
    cpu_seconds: int = 10,
    memory_mb: int = 512,
    on_error: float | None = 0.0,
    max_parallel: int = 4,
    isolation: str = "bwrap",
) -> Callable:
    """A reward named `code_execution`: the fraction of the row's checks that pass when the completion's code (its
    last fenced block, or the whole text) runs in `grpo.rewards.sandbox` (by default under bubblewrap: no network,
    none of the trainer's processes, files or environment variables; the given wall-clock, CPU and memory limits).
    The checks are the row's `cases` (recommended for training) or its `tests`:

    - `cases`: a list (or its JSON text) of `{"call": "add(1, 2)", "expected": 3}`, each call evaluated after the
      code and compared with `expected`, or of `{"stdin": "1 2\\n", "stdout": "3\\n"}`, the code run as a program
      per case. The sandbox sends back plain data and the trainer compares (`sandbox.run_cases`): no faked passes.
    - `tests`: snippets (typically `assert`s) run after the code, in its namespace and its process, which can make
      them pass (an always-equal `__eq__`, a forged count): a policy can learn that, so using them warns once.

    A row with neither gets None, one with both is an error. Code that raises at top level, times out, exceeds a
    limit or tries a refused operation gets `on_error` (0.0, or None to leave the row out). Up to `max_parallel`
    rows run at once. Building the reward checks the sandbox: without bubblewrap it raises `SandboxUnavailable`,
    which says to run `apt-get install bubblewrap`; `isolation="process"` opts into the weaker sandbox by name.

    >>> reward = code_execution(wall_seconds=5)
    >>> reward(["```python\\ndef add(a, b):\\n    return a + b\\n```", "def add(a, b): return a - b",
    ...         "import socket; socket.create_connection(('example.com', 80))"],
    ...        cases=[[{"call": "add(1, 2)", "expected": 3}, {"call": "add(0, 0)", "expected": 0}]] * 3)
    [1.0, 0.5, 0.0]
    """
    # Imported here, not at the top: the sandbox (and ctypes, for its seccomp filters) loads only when asked for.
    from grpo.rewards.sandbox import Limits, check_isolation, run_cases, run_python, stops

    check_isolation(isolation)  # fail when the reward is built, not at the first training step
    limits = Limits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, memory_mb=memory_mb)
    warned = []

    def score(completion, row, stops_before):
        if row is None or stops() != stops_before:  # no row, or Ctrl-C came since the call began: run nothing more
            return None
        code = extract_code(completion_text(completion))
        if row[0] == "cases":
            result = run_cases(code, row[1], limits, isolation=isolation)
        else:
            result = run_python(code, row[1], limits, isolation=isolation)
        return on_error if result.error is not None else result.passed / result.total

    def code_execution(completions, tests=None, cases=None, **kwargs) -> list[float | None]:
        rows = _code_rows(len(completions), tests, cases)
        if not warned and any(row is not None and row[0] == "tests" for row in rows):
            warned.append(True)
            warnings.warn(_TESTS_WARNING, UserWarning, stacklevel=2)
        return _score_in_threads(score, completions, rows, max_parallel)

    code_execution.wall_seconds = wall_seconds  # the trainer warns when reward_timeout is not longer
    return code_execution


def _code_rows(count: int, tests, cases) -> list[tuple[str, list] | None]:
    """Each of the `count` rows' checks (`_code_checks`) for `code_execution`; a TypeError, saying which columns it
    needs, when the dataset has neither."""
    if tests is None and cases is None:
        raise TypeError(
            "code_execution needs a `cases` column (recommended: [{'call': 'add(1, 2)', 'expected': 3}, ...] "
            "per row) or a `tests` column (assert snippets) in the dataset: docs/rewards.md."
        )
    none = [None] * count
    return [_code_checks(i, t, c) for i, (t, c) in enumerate(zip(tests or none, cases or none))]


def _score_in_threads(score: Callable, completions: list, rows: list, max_parallel: int) -> list[float | None]:
    """`score(completion, row, stops_before)` for every row, `max_parallel` sandboxed runs at a time, each in this
    thread's context (so that a timed-out reward call's `CallScope` kills its runs and refuses new ones). On Ctrl-C
    the runs in progress are ended and no other starts (`score` compares `stops_before`), so the threads return
    now."""
    from grpo.rewards.sandbox import stop_running, stops

    pool = ThreadPoolExecutor(max_workers=max(1, max_parallel))
    before = stops()
    try:
        tasks = [pool.submit(run_in_context(score, c, row, before)) for c, row in zip(completions, rows)]
        return [task.result() for task in tasks]
    except KeyboardInterrupt:
        stop_running()
        raise
    finally:
        pool.shutdown(wait=True)
