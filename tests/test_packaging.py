"""environment.yml installs what pyproject.toml declares; README gives the commands CI runs."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_lists_what_pyproject_lists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = names(project["dependencies"])
    for extra in ("lab", "dev"):
        wanted |= names(project["optional-dependencies"][extra])
    env = (ROOT / "environment.yml").read_text()
    pip_section = env.split("- pip:", 1)[1]
    listed = names(re.findall(r"^\s+-\s+(\S.*)$", pip_section, flags=re.M))
    assert "-e ." in pip_section and ".[lab,dev]" in pip_section
    assert wanted - listed == set(), f"environment.yml misses {wanted - listed}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./lab.sh test" in readme and "./lab.sh test" in ci
    assert "./lab.sh demo" in readme
