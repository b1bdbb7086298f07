"""The documentation site: it builds with ``mkdocs build --strict`` (a broken link, a missing
anchor, a page left out of the nav or a failing generator fails the build), and its generated
reference pages name everything the code has. Each page is checked against the code itself,
not against the generator: the settings models' variables, the typer tree's commands, the
app's OpenAPI routes and the metric names in the collector's source."""

from __future__ import annotations

import ast
import html
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer._click.core import Command
from typer.core import TyperGroup

from orderly.api.cli import app
from orderly.api.http import create_app
from orderly.worker.settings import SECTIONS

REPO = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    started = time.monotonic()
    built = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    print(f"mkdocs build --strict: {time.monotonic() - started:.1f} s")
    return out


def page_text(site: Path, name: str) -> str:
    """A built page's text, tags removed and entities decoded."""
    raw = (site / name).read_text()
    article = raw[raw.index("<article") : raw.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def test_the_site_builds_offline_with_search_and_every_nav_page(site: Path) -> None:
    assert (site / "index.html").exists()
    # Material's offline plugin: the search index is a script, pages link files, not folders.
    assert (site / "search" / "search_index.js").exists()
    assert 'href="reference/settings.html"' in (site / "index.html").read_text()
    for page in (
        "tutorials/quick-start.html",
        "tutorials/first-handler.html",
        "how-to/deploy-compose.html",
        "explanation/seed-features.html",
        "architecture.html",
        "benchmarks.html",
        "how-it-works.html",
        "redis-cluster.html",
        "scale-out.html",
        "spark-cluster.html",
    ):
        assert (site / page).exists(), page
    assert (site / "reference" / "openapi.json").exists()


def test_the_quick_start_page_is_the_readme_section(site: Path) -> None:
    text = page_text(site, "tutorials/quick-start.html")
    readme = (REPO / "README.md").read_text()
    for command in ("orderly migrate --create-database", "orderly up > orderly.log 2>&1 &"):
        assert command in readme and command in text


def test_the_settings_page_names_every_variable_of_the_settings_models(site: Path) -> None:
    text = page_text(site, "reference/settings.html")
    variables: set[str] = set()
    for section in SECTIONS:
        for field in section.model_fields.values():
            alias = field.validation_alias
            choices = [alias] if isinstance(alias, str) else getattr(alias, "choices", [])
            variables.update(c for c in choices if isinstance(c, str))
    assert len(variables) > 80
    assert sorted(v for v in variables if v not in text) == []


def _commands(group: TyperGroup, prefix: str) -> list[tuple[str, Command]]:
    found: list[tuple[str, Command]] = []
    for name, command in group.commands.items():
        if not command.hidden:
            found.append((f"{prefix} {name}", command))
            if isinstance(command, TyperGroup):
                found += _commands(command, f"{prefix} {name}")
    return found


def test_the_cli_page_names_every_command_and_option(site: Path) -> None:
    text = page_text(site, "reference/cli.html")
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    commands = _commands(root, "orderly")
    names = [name for name, _ in commands]
    assert {"orderly config list", "orderly config get", "orderly config set"} <= set(names)
    # A heading each (its permalink sign after it), every visible option after the heading.
    assert sorted(n for n in names if f"{n}¶" not in text) == []
    missing = []
    for name, command in commands:
        section = text.split(f"{name}¶", 1)[1]
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in param.opts:
                if opt.startswith("--") and opt != "--help" and opt not in section:
                    missing.append(f"{name} {opt}")
    assert missing == []


def test_the_http_page_names_every_route_of_the_openapi_document(site: Path) -> None:
    text = page_text(site, "reference/http-api.html")
    document = create_app().openapi()
    routes = [
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    ]
    assert len(routes) > 30
    assert sorted(r for r in routes if r not in text) == []


def test_the_metrics_page_names_every_metric_of_the_collector(site: Path) -> None:
    text = page_text(site, "reference/metrics.html")
    # The names as the collector's source writes them (api/metrics.py), counters with the
    # _total the exposition adds.
    source = (REPO / "api" / "metrics.py").read_text()
    tree = ast.parse(source)
    counters = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "CounterMetricFamily"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    names = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"orderly_[a-z_]+", node.value)
    }
    assert len(names) > 25
    # Counters whose name is a variable (the tracking tuple) are named in the tuple itself.
    tuples = re.findall(r'\("(orderly_[a-z_]+)", "[^"]*", t\.', source)
    exposed = {f"{n}_total" if n in counters or n in tuples else n for n in names}
    assert sorted(n for n in exposed if not re.search(rf"\b{n}\b", text)) == []
