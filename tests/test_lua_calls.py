"""The typed calls of the Lua scripts (orderly.worker.lua) against the scripts' headers: one call
per script, each passing as many KEYS as its script's header names, headers that name every key
the script's body reads; a call with another count is refused before Redis sees it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from orderly.worker.core.scripts import LUA_DIR, SCRIPT_NAMES, Call, key_count

ROOT = Path(__file__).resolve().parent.parent
KEY = re.compile(r"\bKEYS\[(\d+)\]")


def header_and_body(script: str) -> tuple[list[str], list[str]]:
    lines = (LUA_DIR / f"{script}.lua").read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if not line.startswith("--"))
    return lines[:n], lines[n:]


def keys_named(lines: list[str]) -> set[int]:
    return {int(k) for line in lines for k in KEY.findall(line)}


def calls() -> list[tuple[str, str, int]]:
    """(where, script, keys given) of every ``Call(...)`` the typed functions build."""
    found = []
    for path in sorted((ROOT / "worker" / "lua").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Call"):
                continue
            where = f"{path.name}:{node.lineno}"
            script = node.args[0] if node.args else None
            assert isinstance(script, ast.Constant), f"{where}: the script by its name"
            keys = next((kw.value for kw in node.keywords if kw.arg == "keys"), None)
            # Every key one by one: a starred or computed sequence cannot be counted here.
            assert isinstance(keys, ast.Tuple), f"{where}: keys=(...) one by one"
            assert not any(isinstance(k, ast.Starred) for k in keys.elts), where
            found.append((where, str(script.value), len(keys.elts)))
    return found


def test_every_script_has_one_call() -> None:
    named = sorted(script for _, script, _ in calls())
    assert named == sorted(SCRIPT_NAMES)


@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_the_header_names_every_key_the_script_reads(script: str) -> None:
    header, body = header_and_body(script)
    named = keys_named(header)
    assert named == set(range(1, len(named) + 1)), f"{script}.lua: KEYS[1..n] in its header"
    assert keys_named(body) <= named, f"{script}.lua reads a key its header does not name"
    assert key_count(script) == len(named)


def test_each_call_passes_as_many_keys_as_its_header_names() -> None:
    wrong = [
        f"{where}: {script} given {given}, its header names {len(keys_named(header))}"
        for where, script, given in calls()
        for header in [header_and_body(script)[0]]
        if given != len(keys_named(header))
    ]
    assert wrong == []


def test_a_call_with_another_key_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"advance\.lua takes 8 keys \(its header\), given 7"):
        Call("advance", keys=("k",) * 7, args=())
    with pytest.raises(KeyError, match="no Lua script named 'advanc'"):
        Call("advanc", keys=(), args=())
    assert Call("wake", keys=("mark", "pokes"), args=(10_000,)).keys == ("mark", "pokes")
