"""Loading a config: recipe files, their base, the command line, merged over the schema, and the
messages that say what is wrong.

Contract: `load_config(argv)` merges, in this order, the schema (`kvrl.config.schema`), the recipe's
base, the recipe and the command-line `key=value` dotlist (the rules of each are `kvrl.config`'s
docstring), makes the result read-only, resolves interpolations, converts it to the dataclasses and
validates it (`kvrl.config.checks`). Every problem raises `ConfigError` whose message names the key,
where it came from (the file, or "command line") and the fix; `kvrl.run` prints it and exits 2. A
value read from the environment never appears in a message in the clear.
"""

import difflib
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_origin

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, GrammarParseError, OmegaConfBaseException, ValidationError

from kvrl.algos import algo_class
from kvrl.config.checks import job_fix, validate
from kvrl.config.schema import kwargs_of, schema, schema_keys
from kvrl.config.shared import Shared
from kvrl.section import ConfigError, cli_value

# keys renamed because the old name misled: old key -> (new key, what it is)
RENAMED = {
    "rl.beta": ("rl.kl_coef", "the weight of the KL to the reference model"),
    "rlkv.beta": ("rlkv.l1_coef", "the weight of RLKV's L1 penalty on the gates"),
}


def recipes_dir() -> Path:
    repo_recipes = Path(__file__).resolve().parents[2] / "recipes"
    return Path(os.environ.get("KVRL_RECIPES_DIR") or repo_recipes)


def available_recipes() -> dict[str, str]:
    """Recipe name -> its description (the first comment line of the file); bases are not recipes. A
    file that cannot be read is listed with what is wrong (`--help` works whatever one recipe holds)."""
    recipes = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            comments = [ln for ln in _read_text(path).splitlines() if ln.startswith("#")]
        except ConfigError as err:
            recipes[path.stem] = f"(unreadable: {str(err).removeprefix(f'{path}: ')})"
            continue
        recipes[path.stem] = comments[0].lstrip("#").strip() if comments else ""
    return recipes


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path}: not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}, line {line}); "
            "save the file as UTF-8"
        ) from None


def _value_syntax(key: str, value: str) -> str:
    """What is wrong with a value the parser refused, and a well-formed one for `key`."""
    default = schema_keys().get(key, (None, None))[1]
    if "${" in value:
        example = default if "${" in str(default) else "${recipe}"
        return f"an interpolation is ${{other.key}}, closed by a brace (got {value!r}); set e.g. {key}={example}"
    if value.lstrip().startswith("["):
        example = cli_value(default) if isinstance(default, list) else "[a,b]"
        return f"a list is [a,b,...], closed by a bracket (got {value!r}); set e.g. {key}={example}"
    if value.lstrip().startswith("{"):
        return (
            f"a mapping is {{name: value, ...}}, closed by a brace (got {value!r}); set e.g. "
            f"{key}='{{name: value}}' (quoted for the shell)"
        )
    return f"the parser refused {value!r}; quote a value with special characters, e.g. {key}='a: b'"


def _parse_cli(argv: Sequence[str]) -> DictConfig:
    for arg in argv:
        key, _, value = arg.partition("=")
        try:  # a byte of argv that is not UTF-8 arrives as a lone surrogate, which YAML cannot read
            arg.encode("utf-8")
        except UnicodeEncodeError:
            key = key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            value = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise ConfigError(
                f"command line: {key}={value} holds a byte that is not UTF-8, and a config is UTF-8 text (its "
                f"runs write it to settings.json and checkpoints); set {key} to a UTF-8 value (a path: rename the "
                "folder, or choose one whose name is UTF-8)"
            ) from None
        if "=" not in arg or not key or "" in key.split("."):
            raise ConfigError(
                f"malformed argument {arg!r}: arguments are key=value with a dotted key, "
                "e.g. `python -m kvrl.run recipe=tiny_rl_full trainer.lr=1e-3`"
            )
        try:
            OmegaConf.from_dotlist([arg])
        except (yaml.YAMLError, OmegaConfBaseException):
            raise ConfigError(f"command line: {key} is malformed: {_value_syntax(key, value)}") from None
    layer, keys = OmegaConf.from_dotlist(list(argv)), schema_keys()
    for arg in argv:  # `key=` (OmegaConf's null) is the empty string where the key takes a string
        key, _, value = arg.partition("=")
        if not value and keys.get(key, (None,))[0] is str:
            OmegaConf.update(layer, key, "")
    return layer


def _valid_value(key: str, before: DictConfig, layer: DictConfig) -> str:
    """A value of `key` the job accepts: the one the layers before `layer` give (the recipe's, else the
    schema's), or, when the job's checks refuse that one, the value their message proposes."""
    value = OmegaConf.select(before, key, default=None, throw_on_missing=False)
    try:
        trial = OmegaConf.merge(before, {})
        job = OmegaConf.select(layer, "job", default=None, throw_on_missing=False)
        if isinstance(job, str):
            trial.job = job
        return job_fix(OmegaConf.to_object(trial), key, value)
    except Exception:  # noqa: BLE001 (only a hint: the layers' own problems are reported when they load)
        return cli_value(value)


def _merge_error(err: OmegaConfBaseException, layer: DictConfig, source: str, before: DictConfig) -> ConfigError:
    """Turn an OmegaConf merge error into a message that names the key and the fix."""
    keys = schema_keys()
    key = str(getattr(err, "full_key", None) or "")
    if isinstance(err, ConfigKeyError) and key in RENAMED:
        new, what = RENAMED[key]
        given = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        return ConfigError(f"{source}: {key} was renamed {new} ({what}); set {new}={cli_value(given)}")
    if isinstance(err, ConfigKeyError) and key:
        section = key.rpartition(".")[0]
        candidates = [k for k in keys if k.rpartition(".")[0] == section]
        # a mistyped section name (trainr.lr) should suggest the section, not a leaf
        candidates += sorted({k.split(".")[0] for k in keys if "." in k and not section})
        near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else "`python -m kvrl.run --help` lists the valid keys"
        return ConfigError(f"{source}: unknown key {key}; {hint}")
    base = key.split("[")[0]
    if isinstance(err, ValidationError) and base in keys:
        expected = keys[base][0]
        name = expected.__name__ if isinstance(expected, type) else str(expected).replace("typing.", "")
        given = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        return ConfigError(
            f"{source}: {key} expects {name}, got {given!r}; set e.g. {base}={_valid_value(base, before, layer)}"
        )
    reason = str(err).splitlines()[0]
    return ConfigError(f"{source}: {reason}; `python -m kvrl.run --help` lists the keys and defaults")


def _read_yaml(path: Path) -> DictConfig:
    text = _read_text(path)
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except GrammarParseError as err:
        raise ConfigError(
            f"{path}: {err.full_key} holds a malformed interpolation ({str(err).splitlines()[0]}); "
            "an interpolation is ${other.key}, closed by a brace, e.g. output_dir: "
            "outputs/${run_name}"
        ) from None
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())}); fix the file") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys to values")
    return layer


def _recipe_path(name: str) -> Path:
    """recipes/NAME.yaml. A name, never a path: `recipe=../../x` or `recipe=/etc/x` would load YAML from
    anywhere under a name that looks like a shipped recipe's (a file of your own is `recipe_file=PATH`)."""
    names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
        raise ConfigError(
            f"recipe={name} is not a recipe name: recipe= takes the name of a file in {recipes_dir()} "
            f"({', '.join(names) or '(none)'}); load a file of your own with recipe_file={name}"
        )
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean recipe={near[0]}? " if near else ""
        raise ConfigError(
            f"unknown recipe {name!r}: no {path}; {hint}available recipes: {', '.join(names) or '(none)'}"
        )
    return path


def _load_recipe(path: Path) -> list[tuple[DictConfig, str]]:
    """The recipe's layers with their sources, to merge in order: its base (if any), then the recipe."""
    recipe = _read_yaml(path)
    if "base" not in recipe:
        return [(recipe, str(path))]
    # `base: NAME`: the keys a method's recipes share, in recipes/base/NAME.yaml (a name, as recipe= takes)
    base = recipe.pop("base")
    base_path = recipes_dir() / "base" / f"{base}.yaml"
    if (
        not isinstance(base, str)
        or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", base)
        or ".." in base
        or not base_path.is_file()
    ):
        names = ", ".join(sorted(p.stem for p in base_path.parent.glob("*.yaml"))) or "(none)"
        raise ConfigError(f"{path}: unknown base {base!r}: no {base_path}; available bases: {names}")
    return [(_read_yaml(base_path), str(base_path)), (recipe, str(path))]


def load_config(argv: Sequence[str]) -> Any:
    """schema ⊕ base ⊕ recipes/NAME.yaml ⊕ `key=value` arguments -> validated, typed Config. A message
    shows values: an environment variable's (read on the command line or in the recipe) as its reference."""
    names = ENV_REFERENCE.findall(" ".join(argv))  # recipe=${oc.env:X} is read before the recipe is
    try:
        return _load_config(argv, names)
    except ConfigError as err:
        raise ConfigError(redact(str(err), names)) from None


def _load_config(argv: Sequence[str], names: list[str]) -> Any:
    """load_config's work; adds to `names` the environment variables the merged layers read."""
    cli = _parse_cli(argv)
    own = str(cli.get("recipe_file") or "")
    if own:
        if "recipe" in cli:
            raise ConfigError(f"recipe={cli.recipe} and recipe_file={own} both name the recipe; give one")
        path = Path(own).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"recipe_file={own}: no such file; give the path of a YAML recipe (or recipe=NAME for "
                f"one in {recipes_dir()})"
            )
        name = path.stem
    else:
        name = str(cli.get("recipe", Shared.recipe))
        path = _recipe_path(name)
    # what the command line chose wins over a `recipe:` / `recipe_file:` written in the file
    cli.recipe, cli.recipe_file = name, own
    layers = _load_recipe(path)
    recipe_path = layers[-1][1]
    # an algorithm of your own (rl.algo=pkg.module:Class) registers its section when its module is imported:
    # before the schema is built, so that its keys are known
    algo = next(
        (
            v
            for layer, _ in reversed(layers + [(cli, "")])
            if isinstance(
                v := OmegaConf.select(
                    layer, "rl.algo", default=None, throw_on_missing=False, throw_on_resolution_failure=False
                ),
                str,
            )
        ),
        "",
    )
    if ":" in algo:
        algo_class(algo)
    merged = OmegaConf.structured(schema())
    for layer, source in layers + [(cli, "command line")]:
        if layer is cli:  # what the command line replaces rather than merges into (the module docstring)
            given = [arg.partition("=")[0] for arg in argv]
            dropped = [
                kw
                for owner, kw in kwargs_of().items()
                if owner in given and str(OmegaConf.select(cli, owner)) != str(OmegaConf.select(merged, owner))
            ]
            whole = [key for key in given if get_origin(schema_keys().get(key, (None,))[0]) is dict]
            for key in dropped + whole:
                OmegaConf.update(merged, key, {}, merge=False)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _merge_error(err, layer, source, merged) from None
    if OmegaConf.is_missing(merged, "job"):
        raise ConfigError(
            f"job is not set; add `job: NAME` to {recipe_path} or pass job=NAME "
            "(`python -m kvrl.run --help` lists the jobs)"
        )
    OmegaConf.set_readonly(merged, True)
    names += ENV_REFERENCE.findall(repr(OmegaConf.to_container(merged, resolve=False)))
    try:
        cfg = OmegaConf.to_object(merged)
        references = _env_references(merged) if names else {}
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "the config"
        raise ConfigError(
            f"cannot resolve {key}: {str(err).splitlines()[0]}; an interpolation names another "
            "key, e.g. output_dir=outputs/${run_name}"
        ) from None
    assert isinstance(cfg, schema())
    cfg.env_references = references
    validate(cfg)
    return cfg


ENV_REFERENCE = re.compile(r"\$\{oc\.env:([^,}]+)")


def redact(text: str, names: Sequence[str]) -> str:
    """`text` with every occurrence of the value of each environment variable in `names` shown as its reference
    `${oc.env:NAME}`, whatever surrounds it (glued to other text, inside a word) and however a message quotes it
    (as is, or inside a repr or JSON string, where a `\\` or a quote is escaped): what kvrl prints about a config
    (its errors, the dry-run plan) never holds a secret in the clear. By value, not by pattern: a short value
    is replaced wherever it stands, even where the text meant something else."""
    forms = {}  # how a value may stand in a message -> its reference
    for name in dict.fromkeys(n.strip() for n in names):
        value = os.environ.get(name)
        if value:
            # repr escapes \ and the quote that delimits it: a ' unless the text holds a ' and no "
            quoted = [repr(value + "'\"")[1:-4], *([repr("'" + value)[2:-1]] if '"' not in value else [])]
            for form in (value, *quoted, json.dumps(value)[1:-1]):
                forms.setdefault(form, f"${{oc.env:{name}}}")
    if not forms:
        return text
    # one pass, longest first: a replaced reference is never searched again (a value may be part of one)
    pattern = "|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True))
    return re.sub(pattern, lambda m: forms[m.group()], text)


def secret_names(cfg) -> list[str]:
    """The environment variables `cfg` read (`Config.env_references`), for :func:`redact`."""
    return ENV_REFERENCE.findall(repr(cfg.env_references))


def _env_references(merged: DictConfig) -> dict[str, Any]:
    """The keys whose value reads an environment variable (`${oc.env:NAME}`, directly or through another
    key's interpolation) -> their value with every such reference left as it is written.

    The variables are resolved into the config (a job needs a token's value), but a checkpoint's
    config.json, W&B and print_config would then hold a secret in the clear: they write these instead
    (`Config.env_references`), so a resumed run compares the references, not the values."""

    def escape(node: Any) -> Any:  # `\${` is OmegaConf's literal `${`: the reference survives resolution
        if isinstance(node, dict):
            return {k: escape(v) for k, v in node.items()}
        if isinstance(node, list):
            return [escape(v) for v in node]
        return node.replace("${oc.env:", "\\${oc.env:") if isinstance(node, str) else node

    escaped = OmegaConf.create(escape(OmegaConf.to_container(merged, resolve=False)))
    references = {}
    for key in schema_keys():
        node = OmegaConf.select(escaped, key, throw_on_missing=False)
        value = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
        if "${oc.env:" in repr(value):
            references[key] = value
    return references
