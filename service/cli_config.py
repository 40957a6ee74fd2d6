"""`serve --config FILE`: flags from a YAML file, as vLLM's `vllm serve --config` reads one.

The file maps long flag names (without the dashes in front; `max-model-len` or
`max_model_len`) to values; `model` is the checkpoint.  Its flags are turned back into a
command line placed before the real one, and a flag (or the model) given on the command
line replaces the file's, so the order of precedence is vLLM's: command line, file,
defaults.  A key that is not a flag of `serve` is an error naming it, not ignored: a typo in
a deployment's file must not silently drop a setting.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _config_path(args: list[str]) -> tuple[str | None, list[str]]:
    """The --config value and the arguments without it."""
    found: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 == len(args):
                raise ValueError("--config needs a YAML file")
            found.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            found.append(arg.partition("=")[2])
        else:
            rest.append(arg)
        i += 1
    if len(found) > 1:
        raise ValueError("--config is given more than once")
    return (found[0] if found else None), rest


def _given_flags(args: Sequence[str]) -> set[str]:
    return {a.partition("=")[0] for a in args if a.startswith("--")}


def _value(flag: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line words that give `action` the YAML `value`."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{flag} is a switch: give it true or false, not {value!r}")
        return [flag] if value else []
    if isinstance(value, bool):  # YAML reads on/off/yes/no as booleans
        word = ("on" if value else "off") if action.choices else str(value).lower()
        return [flag, word]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [w for v in value for w in (flag, str(v))]
        if action.nargs in ("+", "*"):
            return [flag, *map(str, value)]
        raise ValueError(f"{flag} takes one value, not a list")
    if value is None:
        raise ValueError(f"{flag} has no value")
    return [flag, str(value)]


def expand_config_file(args: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`args` (serve's, without the subcommand) with --config's file turned into flags
    placed in front; unchanged when there is no --config."""
    path, rest = _config_path(list(args))
    if path is None:
        return list(args)
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if data is None:
        return rest
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    given = _given_flags(rest)
    known, _ = parser.parse_known_args(rest)  # a positional MODEL on the command line
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: {key!r} is not a flag of pagestream serve")
        if given & set(action.option_strings):
            continue  # the command line's wins
        if flag == "--model" and getattr(known, "model_tag", None) is not None:
            continue
        try:
            out += _value(flag, action, value)
        except ValueError as e:
            raise ValueError(f"--config {path}: {e}") from None
    return out + rest
