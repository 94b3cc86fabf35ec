"""The documentation's facts against the code: the generated configuration reference is current and every field has
help text; the TRL comparison (docs/from-trl.md) names only fields that exist here. The snippets are run by
tests/test_docs_snippets.py, and `make docs` builds the site."""

import dataclasses
import inspect
import re
from pathlib import Path

from grpo import GRPOConfig, GRPOTrainer
from grpo._docs import COMMAND, PAGE, own_fields, render

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_field_has_help_text():
    missing = [f.name for f in own_fields() if not f.metadata.get("help", "").strip()]
    assert not missing, f"GRPOConfig fields without help text in their metadata: {missing}"


def test_config_reference_is_current():
    # The page is generated from grpo/config.py; a field added, renamed or re-documented there changes it.
    assert PAGE.read_text() == render(), (
        f"docs/{PAGE.name} is out of date with grpo/config.py: run `{COMMAND}` and commit the result."
    )


def test_config_reference_lists_every_field():
    page = PAGE.read_text()
    for f in own_fields():
        assert f"| `{f.name}` |" in page


# ---- docs/from-trl.md ----

STATUSES = {"same", "same name, different behaviour", "not supported", "only here"}


def trl_tables() -> dict[str, dict[str, str]]:
    """{"config" | "trainer": {name: status}} from the tables of docs/from-trl.md (the trainer's under the heading
    that names GRPOTrainer, the config's everywhere else)."""
    tables: dict[str, dict[str, str]] = {"config": {}, "trainer": {}}
    section, differences = "config", False
    for line in (DOCS / "from-trl.md").read_text().splitlines():
        if line.startswith("## "):
            section = "trainer" if "GRPOTrainer" in line else "config"
            differences = line.startswith("## Deliberate differences")  # its own table, read by test_trl_parity.py
        if differences:
            continue
        row = re.match(r"^\| `(\w+)` \| ([^|]+?) \|", line)
        if row:
            name, status = row.groups()
            assert status in STATUSES, f"from-trl.md: {name} has status {status!r}, not one of {sorted(STATUSES)}"
            assert name not in tables[section], f"from-trl.md lists {name} twice"
            tables[section][name] = status
    return tables


def test_from_trl_names_exist_here():
    # "same" and "different behaviour" promise a field (or argument) of that name; "not supported" promises none.
    tables = trl_tables()
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    arguments = set(inspect.signature(GRPOTrainer.__init__).parameters) - {"self"}
    for section, names in (("config", fields), ("trainer", arguments)):
        for name, status in tables[section].items():
            if status == "not supported":
                assert name not in names, f"from-trl.md says {name} is not supported, but it exists now: update it"
            else:
                assert name in names, (
                    f"from-trl.md lists {name} as '{status}', but GRPO{section.title()} has no such name"
                )
    assert len(tables["config"]) > 80 and len(tables["trainer"]) > 10  # the parser found the tables


def test_from_trl_lists_every_field():
    # A field added here must say how it relates to TRL (same, different, or only here).
    listed = trl_tables()["config"]
    missing = [f.name for f in own_fields() if f.name not in listed]
    assert not missing, f"docs/from-trl.md does not list these GRPOConfig fields: {missing}"
