"""The documentation holds together: every relative link and anchor in README.md and docs/
resolves, every docs/ path named in running text exists, and the generated reference pages are
what tools/gen_reference.py writes from the code today. What a reader would type is checked too,
in the pages and in the entry points' docstrings: every configuration field named as
``section.field`` exists, every ``--flag`` given to a script under tools/ or benchmarks/ is one
its parser takes, and every repository path named (configs, scripts, data files) exists."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import os
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    """README.md and the other top-level pages (ROADMAP.md, CONTRIBUTING.md, ...), then docs/."""
    return [*sorted(REPO.glob("*.md")), *sorted((REPO / "docs").rglob("*.md"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor, a repeated one numbered as GitHub numbers it (``x``, ``x-1``)."""
    found, counts = set(), {}
    for _, line in prose(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = anchor(match.group(1))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return frozenset(found)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{fragment}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = [problem for path in pages() for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_every_docs_path_named_in_the_text_exists() -> None:
    problems = [f"{path.relative_to(REPO)}:{number}: {name}"
                for path in pages() for number, line in prose(path)
                for name in DOCS_PATH.findall(line) if not (REPO / name).is_file()]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page.write_text("[ok](other.md#a-code-heading) [gone](missing.md) "
                    "[no anchor](other.md#nowhere) [web](https://example.com/x.md)\n"
                    "```\n[in code](ignored.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file", "other.md#nowhere: no heading with anchor #nowhere"]


def reference_generator():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module("gen_reference")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.mark.timeout(300)
def test_the_reference_pages_are_generated_from_the_code_as_it_is() -> None:
    generator = reference_generator()
    for path, text in generator.pages().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(REPO)} is out of date: run python tools/gen_reference.py")


def test_an_undocumented_config_field_is_refused() -> None:
    generator = reference_generator()

    @dataclass
    class Half:
        """Attributes:
        documented: a field with a description."""

        documented: int = 1
        forgotten: int = 2

    with pytest.raises(ValueError, match="forgotten"):
        generator.field_docs(Half)


# What a reader types: configuration fields, flags and paths named in the pages and docstrings.

DESIGN_PAGES = ("engine", "placement", "generation", "refit", "planner", "reliability", "gpu",
                "cpu", "models", "algorithms", "data")
"""docs/<name>.md pages that explain how and why; each stays under DESIGN_PAGE_LINES lines."""
DESIGN_PAGE_LINES = 220
SCRIPT_DIRS = ("tools", "benchmarks")
COMMAND = re.compile(r"(?<![\w./-])((?:tools|benchmarks)/[\w/]+\.py)\b([^`|;&#]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
REPO_PATH = re.compile(
    r"(?<![\w./<-])((?:examples|tools|benchmarks|scripts|tests|megatron_rlhf)/[\w./-]*[\w/])")
FILE_SUFFIXES = frozenset({"py", "md", "json", "jsonl", "yaml", "yml", "safetensors", "model",
                           "txt", "png", "svg", "pt", "sh", "parquet", "bin", "log"})
NOT_FIELDS = frozenset({"model.real_vocab_size", "model.token_vocab_size", "model.embed_tokens",
                        "model.norm", "model.layers", "tokenizer.pad_id", "tokenizer.eos_id",
                        "tokenizer.decoder", "tokenizer.pre_tokenizer",
                        "tokenizer.post_processor"})
"""Attributes of Python objects and Hugging Face weight names the text names, spelled like
configuration fields."""


def script_docstrings() -> list[Path]:
    return sorted(path for folder in SCRIPT_DIRS for path in (REPO / folder).rglob("*.py"))


def texts() -> list[tuple[str, int, str]]:
    """(where, line number, line) of every page but the changelog, code blocks included, and of
    every script's module docstring; a line ending in a backslash is joined with the next."""
    found = []
    for path in pages():
        if path.name == "CHANGELOG.md":
            continue  # it names what was: moved paths, renamed flags
        found += [(str(path.relative_to(REPO)), n, line)
                  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)]
    for path in script_docstrings():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        found += [(str(path.relative_to(REPO)), n, line)
                  for n, line in enumerate(doc.splitlines(), 2)]
    joined, carry = [], None
    for where, number, line in found:
        if carry and carry[0] == where:
            line = carry[2] + " " + line.lstrip()
            number = carry[1]
        carry = (where, number, line[:-1]) if line.rstrip().endswith("\\") else None
        if carry is None:
            joined.append((where, number, line))
    return joined


def _walk(config: object, prefix: str, fields: set[str], open_ended: set[str]) -> None:
    for field in dataclasses.fields(config):
        value, path = getattr(config, field.name), prefix + field.name
        fields.add(path)
        if dataclasses.is_dataclass(value):
            _walk(value, path + ".", fields, open_ended)
        elif isinstance(value, dict) or re.search(r"\bAny\b|\bdict\b", str(field.type)):
            open_ended.add(path)


@functools.cache
def config_fields() -> tuple[frozenset[str], frozenset[str]]:
    """Every dotted field of the PPO, SFT and reward-model configurations, and the fields that
    take a mapping (any key below them is valid)."""
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig

    fields, open_ended = set(), set()
    for cls in (RunConfig, SFTConfig, RMConfig):
        _walk(cls(), "", fields, open_ended)
    return frozenset(fields), frozenset(open_ended)


def _names_a_module(parts: list[str]) -> bool:
    """Whether a prefix of ``parts`` (two or more) is a module or package under megatron_rlhf/:
    ``models.weights.init_weights`` names code, not a field."""
    base = REPO / "megatron_rlhf"
    return any(base.joinpath(*parts[:n]).with_suffix(".py").is_file()
               or base.joinpath(*parts[:n]).is_dir() for n in range(2, len(parts) + 1))


def unknown_fields(lines: list[tuple[str, int, str]]) -> list[str]:
    fields, open_ended = config_fields()
    sections = sorted({f.split(".")[0] for f in fields if "." in f}, key=len, reverse=True)
    names = "|".join(sections)
    token = re.compile(rf"(?<![\w./-])((?:{names})(?:\.[A-Za-z_]\w*)+)(?![\w(])")
    problems = []
    for where, number, line in lines:
        for name in token.findall(line):
            parts = name.split(".")
            if (name in fields or name in NOT_FIELDS or parts[-1] in FILE_SUFFIXES
                    or any(p[0].isupper() for p in parts) or _names_a_module(parts)
                    or any(name.startswith(o + ".") for o in open_ended)):
                continue
            problems.append(f"{where}:{number}: {name} is not a configuration field")
    return problems


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a script built."""


@functools.cache
def script_flags(script: str) -> frozenset[str] | None:
    """The option strings of ``script``'s argparse parser (the script runs as ``__main__`` up to
    its parse), an empty set for a script that parses no arguments, None for a missing one."""
    path = REPO / script
    if not path.is_file():
        return None
    if not re.search(r"\bparse_(known_)?args\(", path.read_text(encoding="utf-8")):
        return frozenset()  # not run: a script that parses nothing may start its work

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    sys.path.insert(0, str(path.parent))
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), \
                mock.patch.object(sys, "argv", [str(path)]):
            runpy.run_path(str(path), run_name="__main__")
    except _Parsed as parsed:
        return frozenset(parsed.args[0]._option_string_actions)
    finally:
        sys.path.remove(str(path.parent))
    raise AssertionError(f"{script}: ran to the end without parsing its arguments")


def unknown_flags(lines: list[tuple[str, int, str]]) -> list[str]:
    problems = []
    for where, number, line in lines:
        for script, rest in COMMAND.findall(line):
            flags = script_flags(script)
            if flags is None:
                continue  # unknown_paths reports it
            problems += [f"{where}:{number}: {script} takes no {flag}"
                         for flag in FLAG.findall(rest) if flag not in flags]
    return problems


def unknown_paths(lines: list[tuple[str, int, str]]) -> list[str]:
    return [f"{where}:{number}: no such path {name}" for where, number, line in lines
            for name in REPO_PATH.findall(line) if not (REPO / name).exists()]


def test_every_configuration_field_named_exists() -> None:
    problems = unknown_fields(texts())
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
def test_every_flag_given_to_a_script_is_one_it_takes() -> None:
    problems = unknown_flags(texts())
    assert not problems, "\n".join(problems)


def test_every_repository_path_named_exists() -> None:
    problems = unknown_paths(texts())
    assert not problems, "\n".join(problems)


def test_the_checkers_find_a_wrong_field_flag_and_path() -> None:
    lines = [("page.md", 1, "Set `rollout.prompts_per_step=8` and `rollout.prompt_per_step`; "
                            "`models.offload.ref=always`, `models/weights.py`, `tokenizer.json`."),
             ("page.md", 2, "    torchrun tools/run_ppo.py --steps 2 --step 3 # not --stepz"),
             ("page.md", 3, "python tools/plot_curves.py --help; see examples/ppo_tiny.yaml "
                            "and examples/ppo_tinny.yaml")]
    assert unknown_fields(lines) == [
        "page.md:1: rollout.prompt_per_step is not a configuration field"]
    assert unknown_flags(lines) == ["page.md:2: tools/run_ppo.py takes no --step"]
    assert unknown_paths(lines) == ["page.md:3: no such path examples/ppo_tinny.yaml"]


def test_design_pages_stay_short() -> None:
    long = [f"docs/{name}.md: {n} lines" for name in DESIGN_PAGES
            if (n := len((REPO / "docs" / f"{name}.md").read_text().splitlines()))
            >= DESIGN_PAGE_LINES]
    assert not long, (f"design pages explain, under {DESIGN_PAGE_LINES} lines each "
                      "(tests list themselves, to-dos go to ROADMAP.md):\n" + "\n".join(long))


MAKING = re.compile(r"\bissues?\s*#?\d+|\bsessions?\b|\blent\b|\bbranch\s+[\w-]*\d|\bthis branch\b",
                    re.IGNORECASE)
"""Words of how the project was built (issue numbers, sessions, lent machines, branches), which a
user-facing page has no use for; the changelog keeps the history that matters."""


def making_of(lines: list[tuple[str, int, str]]) -> list[str]:
    return [f"{where}:{number}: {match.group(0)!r}" for where, number, line in lines
            for match in MAKING.finditer(line)]


def test_pages_say_nothing_of_their_making() -> None:
    problems = making_of(texts())
    assert not problems, ("say what the code does, not how it came to be:\n"
                          + "\n".join(problems))


def test_the_making_of_checker_finds_issue_numbers_and_sessions() -> None:
    lines = [("page.md", 1, "Fixed in issue #16 during the third session."),
             ("page.md", 2, "No host branch on their values; record #17 of the prompts.")]
    assert making_of(lines) == ["page.md:1: 'issue #16'", "page.md:1: 'session'"]


# What the pages claim about the code: module tables, recipes, defaults, the how-tos' reach.

PACKAGE = REPO / "megatron_rlhf"
PY_NAME = re.compile(r"`([\w./-]*\w\.py)`")
BACKTICKED = re.compile(r"`([^`]+)`")


def tables(path: Path) -> list[list[tuple[int, list[str]]]]:
    """Every table outside code blocks: its rows as (line number, cells), the header first and
    the ``---`` separator left out."""
    found, current = [], []
    for number, line in [*prose(path), (0, "")]:
        if line.lstrip().startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                current.append((number, cells))
        elif current:
            found.append(current)
            current = []
    return found


def modules(directory: Path) -> set[str]:
    """The modules a table of ``directory`` lists: its .py files but ``__init__.py``."""
    return {p.name for p in directory.glob("*.py") if p.name != "__init__.py"}


def _module_path(name: str, page: Path, previous: Path | None) -> Path:
    """Where a table's ``name.py`` is: a bare name beside the cell's previous one (else beside
    the page, a package README), a path from the repository or from ``megatron_rlhf/``."""
    if "/" not in name:
        return (previous.parent if previous else page.parent) / name
    for base in (REPO, PACKAGE):
        if (base / name).exists():
            return base / name
    return PACKAGE / name


def _mismatch(where: str, directory: Path, named: set[str], root: Path) -> list[str]:
    missing, extra = sorted(modules(directory) - named), sorted(named - modules(directory))
    shown = os.path.relpath(directory, root)
    return [f"{where}: {shown}/ table lacks {missing}"] * bool(missing) + [
        f"{where}: {shown}/ has no {extra}"] * bool(extra)


def module_table_problems(page: Path, root: Path = REPO) -> list[str]:
    """A table whose first column is headed ``file`` and names .py files lists exactly the
    modules of the directory most of its rows are in (rows of other directories must exist); a
    table with a ``modules`` column lists in each row exactly the modules of the directory its
    first cell links to (``[`step/`](.../step/README.md)``)."""
    problems = []
    for table in tables(page):
        header = [cell.lower() for cell in table[0][1]]
        where = f"{page.relative_to(root)}:{table[0][0]}"
        if "modules" in header:
            column = header.index("modules")
            for number, cells in table[1:]:
                link = LINK.search(cells[0])
                if link and column < len(cells):
                    directory = Path(os.path.normpath(page.parent / link.group(1)))
                    directory = directory.parent if directory.suffix else directory
                    problems += _mismatch(f"{page.relative_to(root)}:{number}", directory,
                                          set(PY_NAME.findall(cells[column])), root)
            continue
        if header[0] != "file":
            continue
        paths = []
        for _, cells in table[1:]:
            previous = None
            for name in PY_NAME.findall(cells[0]):
                previous = _module_path(name, page, previous)
                paths.append(previous)
        if not paths:
            continue  # a table of other files (checkpoint contents)
        directories = [path.parent for path in paths]
        home = max(set(directories), key=directories.count)
        problems += _mismatch(where, home, {p.name for p in paths if p.parent == home}, root)
        problems += [f"{where}: no such module {os.path.relpath(p, root)}" for p in paths
                     if p.parent != home and not p.is_file()]
    return problems


def module_pages() -> list[Path]:
    return [*pages(), *sorted(PACKAGE.rglob("README.md"))]


def test_every_module_table_lists_its_directory() -> None:
    problems = [problem for page in module_pages() for problem in module_table_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_module_table_checker_finds_a_missing_and_a_gone_module(tmp_path: Path) -> None:
    package = tmp_path / "megatron_rlhf" / "pkg"
    package.mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "c.py"):
        (package / name).write_text("")
    readme = package / "README.md"
    readme.write_text("| file | what |\n|---|---|\n| `a.py`, `b.py` | two |\n| `gone.py` | x |\n")
    page = tmp_path / "page.md"
    page.write_text("| room | modules |\n|---|---|\n"
                    "| [`pkg/`](megatron_rlhf/pkg/README.md) | `a.py`, `b.py`, `c.py` |\n")
    assert module_table_problems(readme, tmp_path) == [
        "megatron_rlhf/pkg/README.md:1: megatron_rlhf/pkg/ table lacks ['c.py']",
        "megatron_rlhf/pkg/README.md:1: megatron_rlhf/pkg/ has no ['gone.py']"]
    assert module_table_problems(page, tmp_path) == []


RECIPES = REPO / "examples" / "recipes"
RECIPE_PATH = re.compile(r"examples/recipes/([\w.-]+\.yaml)")


def recipes_named() -> dict[str, list[str]]:
    """Recipe file name -> where the pages name it: as ``examples/recipes/<name>``, or in the
    first column of a table headed ``recipe``."""
    named: dict[str, list[str]] = {}
    for page in pages():
        where = str(page.relative_to(REPO))
        for number, line in prose(page):
            for name in RECIPE_PATH.findall(line):
                named.setdefault(name, []).append(f"{where}:{number}")
        for table in tables(page):
            if table[0][1][0].lower() == "recipe":
                for number, cells in table[1:]:
                    for name in BACKTICKED.findall(cells[0]):
                        named.setdefault(name, []).append(f"{where}:{number}")
    return named


def test_every_recipe_is_in_the_docs_and_every_recipe_named_exists() -> None:
    named = recipes_named()
    unlisted = sorted(p.name for p in RECIPES.glob("*.yaml") if p.name not in named)
    gone = [f"{where}: no recipe {name}" for name, places in sorted(named.items())
            if not (RECIPES / name).is_file() for where in places]
    assert not unlisted, f"recipes no page names: {unlisted} (list them in the recipe table of " \
                         "docs/howto/run-on-a-cluster.md)"
    assert not gone, "\n".join(gone)


DEFAULT_AFTER_FIELD = re.compile(
    r"`([a-z_][\w.]*)(?:\s*[:=]\s*[^`]*)?`\s*\(default:?\s+`?([^\s`()]+)`?\)")
"""``field`` (default ``value``), the field also as ``field: x`` or ``field=x``."""


@functools.cache
def config_defaults() -> dict[str, tuple]:
    """Dotted field -> the defaults it has in the PPO, SFT and reward-model configurations."""
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig

    found: dict[str, list] = {}

    def walk(config: object, prefix: str) -> None:
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + field.name + ".")
            elif value not in found.setdefault(prefix + field.name, []):
                found[prefix + field.name].append(value)

    for cls in (RunConfig, SFTConfig, RMConfig):
        walk(cls(), "")
    return {name: tuple(values) for name, values in found.items()}


def _defaults_of(name: str) -> tuple | None:
    """The defaults of ``name``: a dotted field, or a field's last names when every field so
    named has the same defaults; None when it is no field or an ambiguous one."""
    defaults = config_defaults()
    if name in defaults:
        return defaults[name]
    matches = {defaults[f] for f in defaults if f.endswith("." + name)}
    return matches.pop() if len(matches) == 1 else None


def _same(text: str, default: object) -> bool:
    import yaml

    value = None if text in ("None", "null") else yaml.safe_load(text)
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, int | float) and isinstance(value, int | float):
        return float(value) == float(default)
    return value == default or str(value) == str(default)


def default_claims(lines: list[tuple[str, int, str]]) -> list[tuple[str, str, str]]:
    """(where, field, value) of every ``field`` (default ``value``) in ``lines``."""
    return [(f"{where}:{number}", name, value) for where, number, line in lines
            for name, value in DEFAULT_AFTER_FIELD.findall(line)]


def table_default_claims(page: Path) -> list[tuple[str, str, str]]:
    """(where, field, value) of the rows of a table whose second column is headed
    ``... (default first)``: one field takes the first value, several fields the values in
    turn (what stands in parentheses is a note)."""
    claims = []
    for table in tables(page):
        if len(table[0][1]) < 2 or "(default first)" not in table[0][1][1]:
            continue
        for number, cells in table[1:]:
            names = BACKTICKED.findall(cells[0])
            values = BACKTICKED.findall(re.sub(r"\([^)]*\)", "", cells[1]))
            where = f"{page.relative_to(REPO)}:{number}"
            if len(names) != 1 and len(names) != len(values):
                claims.append((where, ", ".join(names), f"<{len(values)} values>"))
                continue
            claims += [(where, name, value) for name, value in zip(names, values, strict=False)]
    return claims


def wrong_defaults(claims: list[tuple[str, str, str]]) -> list[str]:
    problems = []
    for where, name, value in claims:
        if value.startswith("<"):
            problems.append(f"{where}: {name}: one field or one value per field ({value})")
            continue
        defaults = _defaults_of(name)
        if defaults is not None and not any(_same(value, d) for d in defaults):
            problems.append(f"{where}: {name} defaults to {' or '.join(map(repr, defaults))}, "
                            f"not {value}")
    return problems


def test_every_default_the_pages_state_is_the_codes() -> None:
    claims = default_claims(texts()) + [c for page in pages() for c in table_default_claims(page)]
    assert len(claims) > 10, "the default claims are no longer found: check the patterns"
    problems = wrong_defaults(claims)
    assert not problems, "\n".join(problems)


def test_the_default_checker_finds_a_wrong_default() -> None:
    lines = [("page.md", 1, "`placement.replan.move: true` (default false), "
                            "`algorithm.kl_coef` (default `0.5`), `use_math_verify` (default x)")]
    assert default_claims(lines) == [("page.md:1", "placement.replan.move", "false"),
                                     ("page.md:1", "algorithm.kl_coef", "0.5"),
                                     ("page.md:1", "use_math_verify", "x")]
    assert wrong_defaults(default_claims(lines)) == [
        "page.md:1: algorithm.kl_coef defaults to 0.1, not 0.5"]
    assert wrong_defaults([("t.md:2", "gamma", "0.9"), ("t.md:3", "kl_in", "reward")]) == [
        "t.md:2: gamma defaults to 1.0, not 0.9"]


def test_every_howto_is_linked_from_the_readme_and_the_quickstart() -> None:
    howtos = {p.resolve() for p in (REPO / "docs" / "howto").glob("*.md") if p.name != "README.md"}
    problems = []
    for page in (REPO / "README.md", REPO / "docs" / "quickstart.md"):
        linked = {(page.parent / target.partition("#")[0]).resolve()
                  for _, line in prose(page) for target in LINK.findall(line)}
        problems += [f"{page.relative_to(REPO)} does not link {h.relative_to(REPO)}"
                     for h in sorted(howtos - linked)]
    assert not problems, "\n".join(problems)


REGISTER_DEF = re.compile(r"^def (register_\w+)\(", re.MULTILINE)


def test_contributing_tables_every_registry_the_package_defines() -> None:
    """CONTRIBUTING.md's registry table names each ``register_*`` function the package defines
    (a registry added without its row was "five registries" when there were six)."""
    defined = {name for path in PACKAGE.rglob("*.py")
               for name in REGISTER_DEF.findall(path.read_text(encoding="utf-8"))}
    page = REPO / "CONTRIBUTING.md"
    (table,) = [t for t in tables(page) if t[0][1][:2] == ["registry", "filled by"]]
    tabled = {name for _, cells in table[1:] for name in BACKTICKED.findall(cells[1])}
    assert len(defined) >= 6 and tabled == defined, (
        f"register_* functions without a row: {sorted(defined - tabled)}; rows of none: "
        f"{sorted(tabled - defined)}")
