"""The documentation stands alone and stays true: no pointers outside the repository, links (and their
anchors) that resolve, every `kvtui ...` command in the README and docs/ naming a real command and only
its real options, scripts that exist, the fault table checked against the fault catalogue, the scenario
reference equal to what the schema generates, the README a front page (short, linking every doc) whose
main job writes to an ignored path, and the license pyproject names."""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer

from kvtui.cli.app import app
from kvtui.detect import DETECTOR_NAMES
from kvtui.faults import FAULTS
from kvtui.scenario import schema_docs
from kvtui.scenario.schema import Scenario
from kvtui.scenario.timeline import RUNTIME_KNOBS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "recordings/README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
README_MAX_LINES = 200  # a front page: what kvtui is, set-up, the example output, a tour; the reference is in docs/
# sha256 of the Apache License 2.0 text as the Apache Software Foundation publishes it (LICENSE-2.0.txt)
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.S | re.M)  # a fenced code block, fences included
COMMAND_START = re.compile(r"(?:^|(?<=[\s(\"'$]))kvtui[ \t]+(?=[\w-])")  # `kvtui` as a command, not kvtui's
COMMAND_ENDS = (" #", "&&", "||", ";", " | ", " & ", " > ", "`")  # where the shell ends a command


def text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def repo_text_files() -> list[Path]:
    files = [ROOT / p for p in DOCS + ["pyproject.toml", ".ci/run"]]
    for folder, pattern in (("kvtui", "*.py"), ("kvtui", "*.tcss"), ("scenarios", "*.yaml"), ("tests", "*.py"),
                            ("recordings", "*.jsonl")):
        files += sorted((ROOT / folder).rglob(pattern))
    return files


def test_nothing_points_outside_the_repository():
    forbidden = ["../" + "shared", "DESIGN" + ".md", "issue " + "notes", "source " + "experiment"]
    hits = [f"{path.relative_to(ROOT)}: {word}" for path in repo_text_files()
            for word in forbidden if word in path.read_text(encoding="utf-8")]
    assert hits == []


def headings(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file, outside code blocks."""
    return {schema_docs.anchor(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", markdown), re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    """Every relative link names a file that exists and, when it names a section of a Markdown file, a
    heading that file has (sections moved out of the README left links pointing at anchors it lost)."""
    base = (ROOT / doc).parent
    links = re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", FENCE.sub("", text(doc)))
    missing = [link for link, _ in links if link and "://" not in link and not (base / link).exists()]
    assert missing == []
    broken = [f"{link}{section}" for link, section in links if section and "://" not in link
              and (not link or link.endswith(".md")) and (base / link).exists()
              and section not in headings((base / link if link else ROOT / doc).read_text(encoding="utf-8"))]
    assert broken == []


def test_readme_is_a_front_page_linking_every_doc():
    """The README stays short and sends readers on: it links the docs each topic lives in, and every doc
    is linked from the README or from a doc the README links (no page nobody can reach)."""
    readme = text("README.md")
    assert len(readme.splitlines()) <= README_MAX_LINES
    for target in ("docs/usage.md", "docs/serve.md", "docs/audits.md", "docs/conformance.md", "docs/faults.md",
                   "docs/scenarios.md", "docs/inputs.md", "docs/performance.md", "docs/architecture.md",
                   "docs/dashboard.md", "docs/engine.md", "recordings/README.md"):
        assert f"]({target}" in readme, target
    linked = {(ROOT / link).resolve() for link in re.findall(r"\]\(([^)#\s]+\.md)", readme)}
    reached = set(linked)
    for page in linked:
        reached |= {(page.parent / link).resolve() for link in re.findall(r"\]\(([^)#\s]+\.md)", page.read_text())}
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.resolve() not in reached) == []


def kvtui_commands(markdown: str) -> list[str]:
    """Every `kvtui ...` command line in a Markdown text: in code blocks (shell lines, comments and quoted
    strings included, a line continued with a backslash joined) and in inline code spans, each cut where
    the shell would end it (a comment, `&&`, `;`, a pipe, a redirect, a closing quote)."""
    lines = []
    for block in FENCE.findall(markdown):
        lines += block.replace("\\\n", " ").splitlines()[1:-1]
    for paragraph in FENCE.sub("", markdown).split("\n\n"):
        spans = re.findall(r"(`+)(.+?)(?<!`)\1(?!`)", paragraph.replace("\\|", "|").replace("\n", " "))
        lines += [span for _, span in spans]
    commands = []
    for line in lines:
        for found in COMMAND_START.finditer(line):
            rest = line[found.start():]
            quote = line[found.start() - 1] if found.start() and line[found.start() - 1] in "\"'" else ""
            if quote:
                rest = rest.split(quote, 1)[0]
            end = min([rest.find(mark) for mark in COMMAND_ENDS if mark in rest] + [len(rest)])
            commands.append(" ".join(rest[:end].split()).rstrip(")"))
    return commands


def command_problems(command: str) -> list[str]:
    """What is wrong with one `kvtui ...` line against the command line itself (the Typer app): a command
    kvtui does not have, or an option its command does not have. Placeholders (SCENARIO, URL, `...`) and
    option values are not judged; an option that takes a value skips the next word."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote in prose: judge the words as written
        words = command.split()
    group = typer.main.get_command(app)
    name = words[1]
    if name == "--help" or re.fullmatch(r"[A-Z_]+", name):
        return []
    if name not in group.commands:
        return [f"`{command}`: kvtui has no command {name!r}"]
    takes_value = {"--help": False}
    for param in group.commands[name].params:
        for option in param.opts + param.secondary_opts:
            if option.startswith("-"):
                takes_value[option] = not param.is_flag
    problems, skip = [], False
    for word in words[2:]:
        if skip:
            skip = False
            continue
        word = word.strip("[](),")
        if re.match(r"--?[A-Za-z]", word):
            option = word.split("=", 1)[0]
            if option not in takes_value:
                problems.append(f"`{command}`: `kvtui {name}` has no option {option}")
            skip = takes_value.get(option, False) and "=" not in word
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_kvtui_commands_in_the_docs_are_real(doc):
    """Every `kvtui ...` line a reader may copy names a real command and only options it has."""
    commands = kvtui_commands(text(doc))
    assert [problem for command in commands for problem in command_problems(command)] == []


def test_the_command_check_catches_a_flag_or_command_that_does_not_exist():
    markdown = ("Run `kvtui run scenarios/passphrase.yaml --headles` or ``kvtui serv --port 8000``;\n"
                "``{\"message\": \"The model `x` does not exist.\"}``, kvtui has no limit.\n\n"
                "```sh\nkvtui serve --model x --port 8000 &   # kvtui bench --part overhead\n"
                "kvtui audit s.yaml --timing \\\n    --cache-salt none --probe 4\n"
                "textual serve \"kvtui replay r.jsonl --sumary\"\n```\n")
    assert kvtui_commands(markdown) == ["kvtui serve --model x --port 8000", "kvtui bench --part overhead",
                                        "kvtui audit s.yaml --timing --cache-salt none --probe 4",
                                        "kvtui replay r.jsonl --sumary",
                                        "kvtui run scenarios/passphrase.yaml --headles", "kvtui serv --port 8000"]
    assert [p for c in kvtui_commands(markdown) for p in command_problems(c)] == [
        "`kvtui audit s.yaml --timing --cache-salt none --probe 4`: `kvtui audit` has no option --probe",
        "`kvtui replay r.jsonl --sumary`: `kvtui replay` has no option --sumary",
        "`kvtui run scenarios/passphrase.yaml --headles`: `kvtui run` has no option --headles",
        "`kvtui serv --port 8000`: kvtui has no command 'serv'"]
    # a value that looks like an option belongs to the option before it; a negated flag is an option
    assert command_problems("kvtui run ... --llama-server '-np 2' --no-batch-invariant -q") == []


@pytest.mark.parametrize("doc", DOCS)
def test_scripts_named_in_the_docs_exist(doc):
    named = set(re.findall(r"\bscripts/[\w.-]+\.(?:sh|py)\b", text(doc)))
    assert sorted(name for name in named if not (ROOT / name).is_file()) == []


def test_pointers_in_messages_name_a_doc_and_section_that_exist():
    """A help text or error message that sends the user to the docs names a file that exists, and a section
    it has ("(docs/serve.md, Images)"); none points into the README, which is a front page."""
    sources = {path: path.read_text(encoding="utf-8") for path in sorted((ROOT / "kvtui").rglob("*.py"))}
    into_readme = [f"{path.relative_to(ROOT)}: {hit}" for path, source in sources.items()
                   for hit in re.findall(r"\(README\b[^)]*\)", source)]
    assert into_readme == []
    broken = []
    for path, source in sources.items():
        for doc, section in re.findall(r"\b(docs/[\w.-]+\.md)(?:, ([A-Z][^)\"]*))?\)", source):
            if not (ROOT / doc).is_file():
                broken.append(f"{path.relative_to(ROOT)}: {doc}")
            elif section and schema_docs.anchor(section) not in headings(text(doc)):
                broken.append(f"{path.relative_to(ROOT)}: {doc}, {section}")
    assert broken == []


def test_readme_main_job_records_to_an_ignored_untracked_path():
    readme = text("README.md")
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) == 2  # the main job, then the tests
    main_job, tests = blocks
    assert "<!-- test-command -->\n```bash\n" + tests in readme and "python -m pytest" in tests
    (path,) = re.findall(r"--record (\S+)", main_job)
    assert path == "runs/passphrase.jsonl"
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert ignored.returncode == 0, f"{path} is not ignored by git"
    tracked = subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout == ""


def test_license_is_the_apache_2_text_pyproject_names():
    assert re.search(r'^license = \{ text = "Apache-2.0" \}$', text("pyproject.toml"), re.M)
    license_text = (ROOT / "LICENSE").read_bytes()
    assert license_text.lstrip().startswith(b"Apache License\n") and b"END OF TERMS AND CONDITIONS" in license_text
    assert hashlib.sha256(license_text).hexdigest() == APACHE_2_SHA256


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """Cells of the first table after `heading`, header and rule rows dropped."""
    section = markdown.split(heading, 1)[1]
    table, started = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            table.append([c.strip() for c in line.strip("|").split(" | ")])
        elif started:
            break
    return table[2:]


def test_fault_table_matches_the_catalogue():
    rows = table_rows(text("docs/faults.md"), "## Fault table")
    by_name = {re.fullmatch(r"`(\w+)`", row[0]).group(1): row for row in rows}
    assert list(by_name) == list(FAULTS)
    for name, fault in FAULTS.items():
        layouts, kv, _, _, _, caught_by, kind = by_name[name][1:]
        assert layouts.split(", ") == list(fault.layouts), name
        assert kv.split(", ") == list(fault.kv), name
        assert re.findall(r"`(\w+)`", caught_by) == list(fault.caught_by), name
        assert kind == fault.kind, name


def test_detector_table_lists_every_detector_and_kind():
    faults_doc = text("docs/faults.md")
    detectors = [re.match(r"`(\w+)`", row[0]).group(1) for row in table_rows(faults_doc, "### What each detector")]
    assert detectors == list(DETECTOR_NAMES) + ["request_id", "noninterference"]
    kinds = [re.match(r"`(\w+)`", row[0]).group(1) for row in table_rows(faults_doc, "### Kinds")]
    assert kinds == ["cross_request", "cross_tenant", "corruption", "numeric", "unknown", "hung", "lost",
                     "stopped_serving"]


def test_scenario_reference_is_the_generated_one():
    assert text("docs/scenarios.md") == schema_docs.render(), (
        f"docs/scenarios.md is out of date with the schema; regenerate it with: {schema_docs.REGENERATE}")


def test_scenario_reference_covers_every_model_and_knob():
    documented = {m.__name__ for _, _, models in schema_docs.SECTIONS for m in models}
    assert set(Scenario.model_json_schema()["$defs"]) | {"Scenario"} == documented
    rendered = schema_docs.render()
    for knob in RUNTIME_KNOBS:
        assert f"| `{knob}` |" in rendered
    headings = {schema_docs.anchor(h) for h in re.findall(r"^#+ (.+)$", rendered, re.M)}
    assert set(re.findall(r"\]\((#[\w-]+)\)", rendered)) <= headings


def test_gamma_burstiness_is_explained_as_vllm_does():
    doc = text("docs/scenarios.md")
    gamma = doc.split("### gamma", 1)[1].split("###", 1)[0]
    for phrase in ("shape = burstiness", "scale = 1 / (rate_per_s x burstiness)", "burstiness 1 is exactly Poisson",
                   "below 1", "`--burstiness`"):
        assert phrase in gamma, phrase


# pages that quote other projects' source files (vLLM's, transformers', llama.cpp's) by their own paths
QUOTES_OTHER_SOURCES = {"docs/findings.md", "docs/findings-llama-hybrid.md", "docs/performance.md",
                        "docs/vllm-prompt-embeds.md"}


def test_modules_named_in_the_docs_exist():
    names = set()
    for doc in sorted(set(DOCS) - QUOTES_OTHER_SOURCES):
        names |= set(re.findall(r"`(?:kvtui/)?([\w/]+\.py)`", text(doc)))
    files = {str(p.relative_to(ROOT / "kvtui")) for p in (ROOT / "kvtui").rglob("*.py")}
    files |= {p.name for p in (ROOT / "kvtui").rglob("*.py")}
    # docs may name the test that pins a rule, in its room folder under tests/ (tests/engine/, tests/tui/, ...)
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")}
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.py")}
    files |= {p.name for p in (ROOT / "scripts").glob("*.py")}
    assert sorted(names - files) == []


def test_fault_count_and_names_are_the_catalogues():
    """docs/faults.md's `kvtui faults` sentence gives the catalogue's count and names every fault (in the
    README it said twelve while the catalogue held 21 and more)."""
    faults_doc = text("docs/faults.md")
    found = re.search(r"`kvtui faults` lists (\d+) named faults(.+?)\n\n", faults_doc, re.S)
    assert found is not None, "docs/faults.md: the sentence '`kvtui faults` lists N named faults' is gone"
    assert int(found.group(1)) == len(FAULTS)
    assert set(re.findall(r"`(\w+)`", found.group(2))) >= set(FAULTS)
