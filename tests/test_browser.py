"""The labs' explorers in a real JupyterLab, driven through headless Chromium (Playwright).

For each lab that uses ipywidgets, in one JupyterLab page (it boots once; each next lab opens
through the app's own docmanager:open): open it as a reader of a fresh clone does (untrusted,
no cell run yet) and see each explorer's figure, not widget text; then run its first cell, the
cells tagged `needed-by-explorer` and the explorers (`viz.explore` cells) through the UI; check
that each control starts at the value the code names and shows its whole label, move every
control and check that the figure's pixels change, and that no cell shows an error. The labs'
training runs never run here.

JupyterLab runs on 127.0.0.1 with a token, on copies of the labs, with its own config, data,
runtime and IPython folders in a temporary directory: nothing of the user's is read or written.
Skipped, with the reason, where Playwright or Chromium is missing (`.ci/run` installs Chromium
where it can; never `playwright install`). Screenshots land in tests/artifacts/browser/.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted(
    path.stem
    for path in (ROOT / "labs").glob("*.ipynb")
    if "import ipywidgets" in path.read_text(encoding="utf-8")
)
ARTIFACTS = ROOT / "tests" / "artifacts" / "browser"
CHROMIUM = next(
    (
        p
        for p in (os.environ.get("HPLAB_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium")
        if p and os.path.exists(p)
    ),
    None,
)
TOKEN = "hplab-browser-test"
SETTINGS = {  # no autosave (copies anyway), every cell in the page, no news or update pop-ups
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}

pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (the `lab` extra)")
playwright = pytest.importorskip(
    "playwright.sync_api",
    reason="Playwright is not installed (pip install playwright; no browser download needed)",
)
if CHROMIUM is None:
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)


def cells_to_run(cells: list) -> tuple[list[int], list[int]]:
    """Indices of the cells to run (the lab's first code cell, its imports; cells tagged
    `needed-by-explorer`; the explorers) and of the explorers, the cells calling `viz.explore`."""
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    explorers = [i for i in code if "viz.explore(" in cells[i].source]
    needed = [i for i in code if "needed-by-explorer" in cells[i].metadata.get("tags", [])]
    return sorted({code[0], *needed, *explorers}), explorers


def named_start_values(source: str) -> dict[str, str]:
    """{description: value as the slider's readout shows it} for each `widgets.X(...)` in a
    cell's code given a literal `value=`: what the explorer must start at (no snapping)."""
    named = {}
    for call in ast.walk(ast.parse(source)):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and getattr(call.func.value, "id", "") == "widgets"
        ):
            keywords = {k.arg: k.value for k in call.keywords}
            if {"value", "description"} <= keywords.keys():
                named[ast.literal_eval(keywords["description"])] = str(
                    ast.literal_eval(keywords["value"])
                )
    return named


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server over copies of the labs; yields its base URL and their folder."""
    home = tmp_path_factory.mktemp("jupyter")
    (home / "work" / "labs").mkdir(parents=True)
    for lab in LABS:
        shutil.copy(ROOT / "labs" / f"{lab}.ipynb", home / "work" / "labs")
    for name in ("hplab", "data"):  # the labs import ../hplab (when not pip-installed)
        (home / "work" / name).symlink_to(ROOT / name)
    (home / "config" / "labconfig").mkdir(parents=True)
    (home / "config" / "lab" / "user-settings").mkdir(parents=True)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        IPYTHONDIR=str(home / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    env.pop("MPLBACKEND", None)  # the labs choose `%matplotlib inline` themselves
    settings_dir = home / "config" / "lab" / "user-settings"
    for plugin, values in SETTINGS.items():
        package, name = plugin.split(":")
        (settings_dir / package).mkdir(parents=True, exist_ok=True)
        (settings_dir / package / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={TOKEN}",
        f"--ServerApp.root_dir={home / 'work'}",
        f"--LabApp.user_settings_dir={settings_dir}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",  # (window.jupyterapp: open the next lab in-page)
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(home / "server.log", "wb")
    server = subprocess.Popen(cmd, cwd=home / "work", env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited: {(home / 'server.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer within 60 s")
        yield url, home / "work" / "labs"
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page(browser):
    """One JupyterLab page for every lab: it boots once (seconds on 2 cores), and each lab after
    the first opens in it as a reader opens a file, through the app's own command."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield page
    page.close()


def open_lab(page, url: str, lab: str) -> None:
    """The lab's notebook in the page: the first by its URL (?reset: no tabs from another run),
    the next ones with JupyterLab's docmanager:open."""
    if "/lab" not in page.url:
        page.goto(f"{url}/lab/tree/labs/{lab}.ipynb?reset&token={TOKEN}")
        return
    page.evaluate(
        "async path => { await window.jupyterapp.commands.execute('docmanager:open', {path}) }",
        f"labs/{lab}.ipynb",
    )
    current_tab = ".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel"
    page.locator(current_tab, has_text=f"{lab}.ipynb").wait_for(timeout=60_000)  # it shows


def wait_for_count(cell, count: int, timeout_s: float = 180) -> None:
    """Until the cell's prompt shows `[count]:`, the count a fresh kernel gives its count-th run
    (the saved notebook's own counts could match too early)."""
    prompt = cell.locator(".jp-InputArea-prompt")
    deadline = time.time() + timeout_s
    while prompt.inner_text().strip() != f"[{count}]:":
        if time.time() > deadline:
            pytest.fail(f"cell not done after {timeout_s:.0f} s: {cell.inner_text()[:300]}")
        time.sleep(0.2)


def tracebacks(cell) -> list[str]:
    """The error outputs of a cell (warnings on stderr are not errors)."""
    stderr = cell.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    return [text for text in stderr.all_inner_texts() if "Traceback" in text or "Error" in text]


def move(control, page) -> str:
    """Change one control through the UI like a reader: a key press on a slider's handle, the
    next option of a dropdown, a click on another toggle button. Returns what was done."""
    classes = control.get_attribute("class") or ""
    if "widget-dropdown" in classes:
        select = control.locator("select")
        options = select.locator("option").all_inner_texts()
        target = options[
            (options.index(select.evaluate("s => s.selectedOptions[0].text")) + 1) % len(options)
        ]
        select.select_option(label=target)
        return f"dropdown -> {target}"
    if "widget-toggle-buttons" in classes:
        buttons = control.locator("button")
        for i in range(buttons.count()):
            if "mod-active" not in (buttons.nth(i).get_attribute("class") or ""):
                buttons.nth(i).click()
                return f"toggle -> {buttons.nth(i).inner_text()}"
    handle = control.locator(".noUi-handle")
    handle.focus()
    before = control.locator(".widget-readout").inner_text()
    page.keyboard.press("ArrowRight")
    if control.locator(".widget-readout").inner_text() == before:  # at its maximum
        page.keyboard.press("ArrowLeft")
        page.keyboard.press("ArrowLeft")
    return f"slider {before} -> {control.locator('.widget-readout').inner_text()}"


@pytest.mark.parametrize("lab", LABS)
def test_explorers_redraw_in_jupyterlab(lab, jupyterlab, page):
    url, copies = jupyterlab
    sources = nbformat.read(copies / f"{lab}.ipynb", 4).cells  # what the browser shows
    run, explorers = cells_to_run(sources)
    assert explorers, f"{lab} imports ipywidgets but has no viz.explore cell"
    assert not any("interact(" in cell.source for cell in sources), (
        f"{lab}: ipywidgets' interact leaves the figure frozen under matplotlib's `inline`"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        open_lab(page, url, lab)
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        cells = panel.locator(".jp-Notebook .jp-Cell")
        cells.nth(run[-1]).locator(".jp-InputArea-prompt").wait_for(timeout=60_000)
        assert cells.count() == len(sources), f"{cells.count()} cells shown, {len(sources)} saved"
        for i in explorers:  # as a fresh clone opens (untrusted): the saved figure, no widget text
            saved = cells.nth(i).locator(".jp-OutputArea-output")
            assert "interactive(children" not in " ".join(saved.all_inner_texts())
            assert saved.locator("img").count() == 1, f"{lab} cell {i}: no saved figure"
            saved.first.screenshot(path=str(ARTIFACTS / f"{lab}-cell{i}-as-saved.png"))
        panel.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').wait_for(
            timeout=120_000
        )  # the kernel has started
        for count, i in enumerate(run, start=1):
            cell = cells.nth(i)
            cell.locator(".jp-InputArea-prompt").click()
            page.keyboard.press("Control+Enter")
            wait_for_count(cell, count)
            assert not tracebacks(cell), f"{lab} cell {i}: {tracebacks(cell)[0][-800:]}"
            if i not in explorers:
                continue
            image = cell.locator(".widget-image")
            image.wait_for(timeout=30_000)
            controls = cell.locator(".widget-hbox > .widget-inline-hbox")
            assert controls.count() >= 2, f"{lab} cell {i}: {controls.count()} controls"
            named = named_start_values(sources[i].source)
            for c in range(controls.count()):
                label = controls.nth(c).locator(".widget-label").first
                assert label.evaluate("e => e.scrollWidth <= e.clientWidth"), (
                    f"{lab} cell {i}: the label {label.inner_text()!r} is cut"
                )
                readout = controls.nth(c).locator(".widget-readout")
                if label.inner_text() in named and readout.count():
                    assert readout.inner_text() == named[label.inner_text()], (
                        f"{lab} cell {i}: {label.inner_text()} starts at {readout.inner_text()}"
                    )
                before = image.screenshot()
                done = move(controls.nth(c), page)
                deadline = time.time() + 30
                while image.screenshot() == before and time.time() < deadline:
                    time.sleep(0.2)
                assert image.screenshot() != before, (
                    f"{lab} cell {i}: the figure did not change after {done}"
                )
            cell.screenshot(path=str(ARTIFACTS / f"{lab}-cell{i}-moved.png"))
            assert not tracebacks(cell), f"{lab} cell {i}: {tracebacks(cell)[0][-800:]}"
    finally:
        sessions = json.load(urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}"))
        for session in sessions:  # stop this lab's kernel: the next lab gets the cores
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{url}/api/sessions/{session['id']}?token={TOKEN}", method="DELETE"
                )
            )
