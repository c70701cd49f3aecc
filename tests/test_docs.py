"""The documentation stands alone and stays true: no pointers outside the repository, links that
resolve, the fault table checked against the fault catalogue, the scenario reference equal to what the
schema generates, the README's main job writing to an ignored path, and the license pyproject names."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from kvtui.detect import DETECTOR_NAMES
from kvtui.faults import FAULTS
from kvtui.scenario import schema_docs
from kvtui.scenario.schema import Scenario
from kvtui.scenario.timeline import RUNTIME_KNOBS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/architecture.md", "docs/faults.md", "docs/scenarios.md", "docs/findings.md",
        "recordings/README.md"]
# sha256 of the Apache License 2.0 text as the Apache Software Foundation publishes it (LICENSE-2.0.txt)
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"


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


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    base = (ROOT / doc).parent
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text(doc))
    missing = [link for link in links if "://" not in link and not (base / link).exists()]
    assert missing == []


def test_readme_links_the_docs():
    readme = text("README.md")
    for target in ("docs/architecture.md", "docs/faults.md", "docs/scenarios.md", "recordings/README.md"):
        assert f"]({target})" in readme, target


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


def test_modules_named_in_the_docs_exist():
    names = set()
    for doc in ("docs/architecture.md", "docs/faults.md"):
        names |= set(re.findall(r"`(?:kvtui/)?([\w/]+\.py)`", text(doc)))
    files = {str(p.relative_to(ROOT / "kvtui")) for p in (ROOT / "kvtui").rglob("*.py")}
    files |= {p.name for p in (ROOT / "kvtui").rglob("*.py")}
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}  # docs may name the test that pins a rule
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.py")}
    assert sorted(names - files) == []


def test_fault_count_and_names_are_the_catalogues():
    """docs/faults.md's `kvtui faults` sentence gives the catalogue's count and names every fault (in the
    README it said twelve while the catalogue held 21 and more)."""
    faults_doc = text("docs/faults.md")
    found = re.search(r"`kvtui faults` lists (\d+) named faults(.+?)\n\n", faults_doc, re.S)
    assert found is not None, "docs/faults.md: the sentence '`kvtui faults` lists N named faults' is gone"
    assert int(found.group(1)) == len(FAULTS)
    assert set(re.findall(r"`(\w+)`", found.group(2))) >= set(FAULTS)
