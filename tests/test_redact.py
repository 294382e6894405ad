"""A value read with `${oc.env:NAME}` never reaches what kvrl.run prints, whatever surrounds it."""

import json

import pytest

from kvrl.run import main

SECRETS = ["SeKrEt123", "back\\slash", "it's", "both'\"quotes\\"]


def shown_forms(value: str) -> set[str]:
    """How a message may hold `value`: as is, in a repr (either quote) or in JSON."""
    return {value, repr(value)[1:-1], repr(value + "'\"")[1:-4], repr("'" + value)[2:-1], json.dumps(value)[1:-1]}


@pytest.mark.parametrize("secret", SECRETS)
def test_a_secret_glued_to_text_is_not_in_an_error(monkeypatch, capsys, secret):
    """`env.id=kvrl/x${oc.env:TOK}` printed env.id='kvrl/xSeKrEt123': only a value standing alone was redacted,
    and one holding a \\ or a ' was shown escaped by repr, which the redaction did not look for."""
    monkeypatch.setenv("KVRL_TEST_TOKEN", secret)
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    assert main(["recipe=tiny_rl_full", "env.id=kvrl/x${oc.env:KVRL_TEST_TOKEN}y", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "env.id=" in err and "${oc.env:KVRL_TEST_TOKEN}" in err, err
    assert not any(form in err for form in shown_forms(secret)), err


def test_a_secret_is_not_in_the_dry_run_plan(monkeypatch, capsys):
    """The plan names the recipe and the model: read from the environment, it printed their values."""
    monkeypatch.setenv("KVRL_TEST_TOKEN", "tiny_rl_full")
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    assert main(["recipe=${oc.env:KVRL_TEST_TOKEN}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dry run of recipe=${oc.env:KVRL_TEST_TOKEN} (job=rl)" in out and "tiny_rl_full" not in out, out
