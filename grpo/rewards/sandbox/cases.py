"""Test cases whose verdict is computed outside the sandbox (`run_cases`): each a call expression with the value it
must return, or, for a program, the text for its stdin with what it must print.

    check_cases([{"call": "add(1, 2)", "expected": 3}, {"call": "add('a', 'b')", "expected": "ab"}])
    check_cases('[{"stdin": "1 2\\n", "stdout": "3\\n"}]')  # JSON text, as a datasets column may hold it

Only the inputs enter the sandbox (`case_inputs`). The process that ran the code sends back what each call returned,
or what each run printed, as plain data (JSON: None, bool, int, float, str, list, dict; harness.plain_problem); the
trainer compares it here with the expected values (`judge`), which never enter the sandbox. So the code cannot know
what to report, and no object of its own (an `__eq__` that is always True) crosses the boundary: the comparison is
this module's, on values JSON made.
"""

from __future__ import annotations

import json

from grpo.rewards.sandbox.harness import plain_problem

CALL_KEYS, PROGRAM_KEYS = ("call", "expected"), ("stdin", "stdout")
FORMS = '{"call": "add(1, 2)", "expected": 3} or {"stdin": "1 2\\n", "stdout": "3\\n"}'


def check_cases(cases) -> list[dict]:
    """The cases in one form each, `{"call": str, "expected": plain data}` (tuples become lists) or
    `{"stdin": str, "stdout": str}`, all of one kind. Takes a list of such dicts, one dict, or JSON text of either. A
    key set to None counts as absent, except `expected` (None is a value a call may return): a `datasets` column
    holding both kinds fills each dict with the other kind's keys, set to None. Raises ValueError naming the case and
    the fix."""
    if isinstance(cases, str):
        try:
            cases = json.loads(cases)
        except ValueError as e:
            raise ValueError(
                f"The cases are text but not JSON ({e}): give a list of cases, or its json.dumps(...), each {FORMS}."
            ) from None
    if isinstance(cases, dict):
        cases = [cases]
    if not isinstance(cases, (list, tuple)):
        raise ValueError(f"The cases are a {type(cases).__name__}: give a list of cases, each {FORMS}.")
    checked = [_check_case(i, case) for i, case in enumerate(cases)]
    if len({"call" in case for case in checked}) > 1:
        raise ValueError(
            "The cases mix calls and programs (stdin/stdout): a row's code is either called or run as a program, so "
            "give one kind per row."
        )
    return checked


def _check_case(i: int, case) -> dict:
    if not isinstance(case, dict):
        raise ValueError(f"Case {i} is a {type(case).__name__}, not a dict: write each case as {FORMS}.")
    unknown = sorted(str(k) for k in case if k not in CALL_KEYS + PROGRAM_KEYS)
    if unknown:
        raise ValueError(f"Case {i} has unknown keys {unknown}: write each case as {FORMS}.")
    if case.get("call") is not None:
        extra = [k for k in PROGRAM_KEYS if case.get(k) is not None]
        if extra or "expected" not in case:
            problem = f"also has {extra}" if extra else "has no 'expected' (write None if the call returns None)"
            raise ValueError(f"Case {i} has a call and {problem}: write it as {FORMS}.")
        call, expected = case["call"], case["expected"]
        if not isinstance(call, str):
            raise ValueError(f"Case {i}'s call is a {type(call).__name__}: write the call as Python text, 'f(1)'.")
        try:
            compile(call, "<case>", "eval")
        except SyntaxError as e:
            raise ValueError(
                f"Case {i}'s call {call!r} is not a Python expression ({e.msg}): write what is called, such as "
                "'add(1, 2)', and put the value it must return in 'expected'."
            ) from None
        problem = plain_problem(expected)
        try:
            expected = json.loads(json.dumps(expected)) if problem is None else None
        except ValueError as e:
            problem = str(e)
        if problem is not None:
            raise ValueError(
                f"Case {i}'s expected value cannot be compared ({problem}): what the code returns crosses the "
                "sandbox as JSON, so give the expected value as None, bool, int, float, str, or a list or dict of "
                "them (convert inside the call, e.g. 'sorted(f(x))' for a set)."
            )
        return {"call": call, "expected": expected}
    if case.get("stdout") is None:
        raise ValueError(f"Case {i} has neither a call nor a stdout: write each case as {FORMS}.")
    if case.get("expected") is not None:
        raise ValueError(f"Case {i} has a stdout and an 'expected': a program's case is {{'stdin', 'stdout'}}.")
    stdin = "" if case.get("stdin") is None else case["stdin"]
    if not isinstance(stdin, str) or not isinstance(case["stdout"], str):
        raise ValueError(f"Case {i}'s stdin and stdout must be text (str).")
    return {"stdin": stdin, "stdout": case["stdout"]}


def case_inputs(cases: list[dict]) -> list[dict]:
    """What enters the sandbox of each checked case: its call, or its stdin; never what it must return or print."""
    return [{"call": c["call"]} if "call" in c else {"stdin": c["stdin"]} for c in cases]


def same(got, expected) -> bool:
    """Equality of two JSON values, by this function's rules only: numbers by value (3 == 3.0; NaN equals
    nothing), but a bool only equals the same bool (True is not 1); strings and None as themselves; lists item by
    item; dicts with the same keys, value by value.

    >>> same([1, 2.0, {"a": None}], [1.0, 2, {"a": None}]), same(True, 1), same([1], [1, 1])
    (True, False, False)
    """
    numbers = (int, float)
    if type(got) is bool or type(expected) is bool:
        return type(got) is type(expected) and got == expected
    if type(got) in numbers and type(expected) in numbers:
        return got == expected
    if type(got) is not type(expected):
        return False
    if type(got) is list:
        return len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected))
    if type(got) is dict:
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in got)
    return got == expected  # str or None


def same_output(printed: str, expected: str) -> bool:
    """Whether a program printed the expected text, up to whitespace at the end of each line and blank lines at the
    end (the usual rule of judges of programming contests).

    >>> same_output("3 \\n\\n", "3"), same_output("3\\n4\\n", "3 4\\n")
    (True, False)
    """

    def lines(text):
        kept = [line.rstrip() for line in text.splitlines()]
        while kept and not kept[-1]:
            kept.pop()
        return kept

    return lines(printed) == lines(expected)


def judge(cases: list[dict], results: list) -> tuple[int, tuple[str, ...]]:
    """(how many cases passed, why each of the others failed) from the sandbox's results, one `[True, value]` or
    `[False, why]` per checked case, in order. Only `same` and `same_output` decide."""
    passed, failures = 0, []
    for i, (case, (ok, value)) in enumerate(zip(cases, results)):
        what = _cut(case["call"]) if "call" in case else "stdin " + _cut(repr(case["stdin"]))
        if not ok:
            failures.append(f"case {i} ({what}): {_cut(value, 300)}")
        elif "call" in case and not same(value, case["expected"]):
            failures.append(
                f"case {i} ({what}): returned {_cut(repr(value))}, expected {_cut(repr(case['expected']))}"
            )
        elif "stdout" in case and not same_output(value, case["stdout"]):
            failures.append(f"case {i} ({what}): printed {_cut(repr(value))}, expected {_cut(repr(case['stdout']))}")
        else:
            passed += 1
    return passed, tuple(failures)


def _cut(text: str, chars: int = 100) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."
