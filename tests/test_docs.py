"""The documentation's facts against the code: the generated configuration reference is current and every field has
help text; the TRL comparison (docs/from-trl.md) names only fields that exist here. The snippets are run by
tests/test_docs_snippets.py, and `make docs` builds the site."""

from pathlib import Path

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
