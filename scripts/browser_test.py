"""Drive the planner of notebook 00 in a real browser (issue 16): JupyterLab from this checkout's environment on
127.0.0.1 with a token, headless Chromium through Selenium, notebook 00 run top to bottom, then the planner's controls
changed; asserts the plan changed each time, then checks Notebook 7 too, and saves screenshots under build/browser/.

    python scripts/browser_test.py            # exit status 0 when every check passed; ~2-4 min on 2 CPU cores
    python scripts/browser_test.py --classic [--env build/colab-widgets-env]   # classic Notebook 6, Colab's widgets

Needs (not in requirements*.txt: CI does not run it):
    apt-get install -y chromium chromium-driver     # Debian's headless browser and its driver
    .venv/bin/pip install selenium                  # the Python side (tried with selenium 4.51)

What it checks, in JupyterLab:
- the planner renders as live controls with the coloured verdict line, the plan's picture (stacked bars against the
  budgets) and the JSON's download link (no "Error displaying widget"); no control's label is cut off;
- typing a model name does not re-plan until Enter (issue 16, problem 1): the verdict is unchanged while typing;
- Enter on the new name, then ZeRO stage 3 from its dropdown, then an exact micro-batch (16) each change the verdict
  or the folded JSON, and the picture; on a runtime without a GPU, micro-batch 4 -> 16 raises the verdict's RAM total
  (issue 23, item 4: activations count in RAM there);
- a micro-batch of 2000 stays 2000 in the field and in the plan's JSON (no silent cap at 1024), raises the RAM total,
  and its apply button proposes a smaller micro-batch that fits;
- "download ds_config.json" saves the JSON the details show; "copy JSON" puts it on the clipboard;
- a Hub id the Hub does not answer for (the kernel's HF_ENDPOINT is a local socket that never answers) shows
  "looking up ..." and then its error in the widget within seconds;
- restart-safe: the output also holds a static copy of the last plan (with its picture), hidden while the widget
  lives; after saving, shutting the kernel down and reloading the page, that copy is what shows, and the widget's
  "Error displaying widget: model not found" is hidden;
- a narrow column (issue 23, item 5): the window at 900 px with the file browser open, the chart is drawn at its own
  pixel size (the img's rendered width = its natural width: labels not shrunk) in its own box (.ds-figure-scroll)
  that stays inside the output column and scrolls sideways (on failure: the box's ancestors, and whether
  `min-width: 0` on the picture's HTML widget would fix it); the apply button's label is not cut (scrollWidth <=
  clientWidth; a long fix, gpt2-xl's, and a refusal's);
- a refused combination (ZeRO stage 0 with parameter offload) shows "config refused" with an apply button, and
  applying it gives a plan that is not refused (ZeRO-3).
Then in Notebook 7 (served by the same server), the same notebook on the kernel JupyterLab left running: the live
planner restored from it, checked the same way (picture, download link, labels, a stage change); the kernel restarted
as the Kernel menu does (issue 23, item 5): the banner "Re-run this cell for the live planner" shows, the dead
controls are hidden (or greyed, refusing the pointer) and no live verdict shows; then saved, shut down and reopened
there (static copy, no widget error); last, the notebook reopened in JupyterLab without a kernel. With
`--skip-notebook7` the kernel restart is checked in JupyterLab itself.
Notebooks run from copies in build/browser/nb/ (the front ends autosave; notebooks/ stays untouched). The kernel does
not get DS_COURSE_SAVED_RUN (that would make the planner static HTML).

`--classic` (issue 21: Colab's kernel runs ipywidgets 7.7.1, ipykernel 6.17.1, IPython 7.34.0): the server AND the
kernel come from a venv holding Colab's versions, classic Notebook 6.5.7 with widgetsnbextension 3.6.10 (its
nbextension is enabled by its own install), and notebook 00 runs top to bottom in classic Notebook's UI (/notebooks/).
Build that venv (~70 s, then DeepSpeed and the course without changing Colab's versions):
    .venv/bin/python scripts/colab_software.py build-env build/colab-widgets-env --torch local
    build/colab-widgets-env/bin/pip install deepspeed==0.19.8 -c build/colab-widgets-env/colab-constraints.txt
    build/colab-widgets-env/bin/pip install --no-deps --no-build-isolation -e .
It checks: the kernel is that venv's, with ipywidgets 7.7.1; no traceback and no widget error; the training progress
bar, once finished, is its final line of text (100 %), not 0 % and not nothing (ipywidgets 7 displays a widget without
a display id: helpers.progress displays its mimebundle itself); the planner renders with spaced controls (margins:
no Layout has `gap`) and re-plans on Enter, on a stage change and on an exact micro-batch, takes the JSON, fails an
unanswered Hub id in the widget; the micro-batch's RAM, 2000, the narrow column (900 px, no file browser there) and
the refusal's apply as in JupyterLab; the kernel restarted (Kernel > Restart's call: the banner, the dead controls
hidden or greyed); then saved, its kernel shut down and the page reloaded (classic Notebook starts a new
kernel, which holds none of the widgets): the bar's final text and the planner's static copy show, and nothing else in
the planner's cell (no "A Jupyter widget could not be displayed", no `VBox(children=...` text). Screenshots under
build/browser/classic/; the notebook runs from build/browser/classic/nb/. Op builds of that venv go to
build/torch_ext_colab (two venvs sharing one extensions folder rebuild each other's ops).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "00_setup_and_ds_report.ipynb"
OUT = ROOT / "build" / "browser"
PLANNER = "//div[contains(@class,'ds-planner')]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def silent_hub() -> socket.socket:
    """A local socket that accepts connections and never answers: the kernel's Hugging Face Hub (HF_ENDPOINT), so a
    Hub lookup can only time out, and nothing is asked of the real Hub."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server


def start_lab(port: int, token: str, hub_endpoint: str) -> subprocess.Popen:
    """JupyterLab of this interpreter's environment, serving ROOT (Notebook 7 too, at /notebooks/), with the apps
    exposed for commands and every cell kept in the page (windowing off) so the planner can be found wherever it is."""
    settings = OUT / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = {k: v for k, v in os.environ.items() if k != "DS_COURSE_SAVED_RUN"}
    env["HF_ENDPOINT"] = hub_endpoint
    log = open(OUT / "jupyterlab.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={OUT / 'lab-settings'}", f"--LabApp.workspaces_dir={OUT / 'lab-workspaces'}",
         "--JupyterNotebookApp.expose_app_in_browser=True",
         f"--JupyterNotebookApp.user_settings_dir={OUT / 'lab-settings'}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly",
         *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_server(port: int, token: str, timeout: float = 60, log: Path = OUT / "jupyterlab.log") -> None:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"The Jupyter server did not answer on port {port} within {timeout:.0f} s (see {log})")


def browser(width: int, height: int, downloads: Path):
    """Headless Chromium that saves downloads into `downloads` without asking."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                           "download.prompt_for_download": False})
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(service=service, options=opts)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            self.failures.append(what)


def wait(driver, condition, timeout: float, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(condition, message=what)


def verdict_text(driver) -> str:
    """The verdict line's text, read in the page each time (the HTML widget replaces its element on every plan)."""
    return driver.execute_script(
        "const v = document.querySelector('.ds-planner .ds-plan-verdict'); return v ? v.textContent.trim() : '';")


def json_text(driver) -> str:
    """The folded details' text (present in the page even while the accordion is closed)."""
    return driver.execute_script(
        "const p = document.querySelector('.ds-planner .jupyter-widget-Collapse-contents, "
        ".ds-planner .widget-accordion pre, .ds-planner pre'); return p ? p.textContent : '';")


def planner_state(driver) -> dict:
    """What a learner sees of the live planner: the picture loaded, the download link, labels cut off, a widget error
    or the static copy shown."""
    return driver.execute_script("""
        const p = document.querySelector('.ds-planner');
        const img = p && p.querySelector('img.ds-plan-picture');
        const cut = p ? [...p.querySelectorAll('.widget-label, label')].filter(l => l.offsetParent &&
            l.scrollWidth > l.clientWidth + 1).map(l => l.textContent) : [];
        return {picture: !!(img && img.complete && img.naturalWidth > 300), src: img ? img.src.slice(-80) : '',
                download: !!(p && p.querySelector('a.ds-plan-download[download="ds_config.json"]')),
                cut_labels: cut};""")


def visible_widget_errors(driver, planner_only: bool = True) -> list[str]:
    """Widget errors a learner would read (an element hidden by CSS has no offsetParent): in the planner's output area,
    or (`planner_only=False`) anywhere, e.g. a tqdm progress bar's widget of the training cell."""
    area = ".jp-OutputArea:has(.ds-plan-static) " if planner_only else ""
    return driver.execute_script(
        f"return [...document.querySelectorAll('{area}.jp-OutputArea-output')].filter(o => o.offsetParent &&"
        " /Error displaying widget|Loading widget/.test(o.textContent)).map(o => o.textContent.slice(0, 120) + ' (cell: '"
        " + ((o.closest('.jp-Cell') || o).querySelector('.jp-InputArea, .CodeMirror, .cm-content') || o).textContent"
        ".slice(0, 80) + ')');")


def static_copy_state(driver) -> dict:
    """The static copy of the last plan, as a reopened notebook shows it."""
    return driver.execute_script("""
        const s = document.querySelector('.ds-plan-static');
        if (!s) return {shown: false, text: '', picture: false, download: false};
        const img = s.querySelector('img.ds-plan-picture');
        return {shown: !!s.offsetParent, text: s.textContent.slice(0, 400),
                picture: !!(img && img.complete && img.naturalWidth > 300),
                download: !!s.querySelector('a.ds-plan-download')};""")


def reopen_without_kernel(driver, check: Check, where: str, expect: tuple[str, ...], reload_only: bool = False) -> None:
    """Save, shut the kernel down, reload (or, `reload_only`, the page is a fresh open of the saved notebook): the
    static copy (with its picture) shows and no widget error does."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By

    if not reload_only:
        driver.execute_script("window.jupyterapp.commands.execute('docmanager:save');")
        time.sleep(3)
        driver.execute_script("window.jupyterapp.shell.currentWidget.sessionContext.shutdown();")
        time.sleep(3)
        driver.refresh()
    try:
        wait(driver, lambda d: static_copy_state(d)["shown"], 120, "the static copy in the reopened notebook")
        time.sleep(3)  # the widget manager gives up on the saved widget ("model not found") by now
        state = static_copy_state(driver)
        check("re-run this cell" in state["text"].lower() and all(e in state["text"] for e in expect) and state["picture"]
              and state["download"], f"{where}: reopened without its kernel, the notebook shows the last plan, its "
              f"picture and the download link: {state['text'][:100]!r}")
        errors = visible_widget_errors(driver)
        check(not errors, f"{where}: no 'Error displaying widget' under the static copy" + (f": {errors}" if errors
                                                                                             else ""))
        others = visible_widget_errors(driver, planner_only=False)
        check(not others, f"{where}: no 'Error displaying widget' anywhere in the reopened notebook (a finished "
              f"progress bar leaves a line of text)" + (f": {others}" if others else ""))
    except TimeoutException:
        check(False, f"{where}: reopened without its kernel, the notebook shows the last plan")
    statics = driver.find_elements(By.CLASS_NAME, "ds-plan-static")
    if statics:
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", statics[0])
        time.sleep(0.5)


def shot(driver, name: str, out: Path = OUT) -> Path:
    from selenium.webdriver.common.by import By

    path = out / name
    for no in driver.find_elements(By.XPATH, "//div[contains(@class,'jp-Notification-Toast')]//button[.='No']"):
        no.click()  # "Would you like to get notified about official Jupyter news?"
    planner = driver.find_elements(By.XPATH, PLANNER)
    if planner:
        driver.execute_script(  # the planner's top just under the toolbar
            "const e = arguments[0]; e.scrollIntoView({block: 'start'}); let p = e.parentElement;"
            "while (p && !(p.scrollHeight > p.clientHeight && /auto|scroll/.test(getComputedStyle(p).overflowY)))"
            "  p = p.parentElement;"
            "if (p) p.scrollBy(0, -40);", planner[0])
        time.sleep(0.5)
    driver.save_screenshot(str(path))
    print(f"     screenshot {path.relative_to(ROOT)}", flush=True)
    return path


def kernel_idle(driver) -> bool:
    """The current notebook's kernel is started and idle (JupyterLab and Notebook 7 alike)."""
    return driver.execute_script(
        "const a = window.jupyterapp; if (!a) return false; const w = a.shell.currentWidget;"
        "return !!(w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle');")


def run_all_and_wait(driver, timeout: float) -> None:
    """Run every cell of the open notebook; wait for the planner's verdict and for every cell to finish."""
    from selenium.webdriver.common.by import By

    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    wait(driver, lambda d: d.find_elements(By.XPATH, PLANNER + "//div[contains(@class,'ds-plan-verdict')]"),
         timeout, "the planner's verdict line")
    wait(driver, lambda d: d.execute_script(
        "const w = window.jupyterapp.shell.currentWidget; const k = w.sessionContext.session.kernel;"
        "const busy = [...document.querySelectorAll('.jp-InputPrompt')].some(p => p.textContent.includes('*'));"
        "return k.status === 'idle' && !busy;"), timeout, "every cell to finish")


def check_dashboard(driver, check: Check, where: str) -> None:
    """The live planner: its picture, its download link, no control label cut off."""
    state = planner_state(driver)
    check(state["picture"], f"{where}: the plan's picture (stacked bars against the budgets) is shown")
    check(state["download"], f"{where}: the DeepSpeed JSON has its download link")
    check(not state["cut_labels"], f"{where}: no control's label is cut off" + (
        f": {state['cut_labels']}" if state["cut_labels"] else ""))


def select_stage(driver, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    stage = driver.find_element(By.XPATH, PLANNER + "//div[contains(@class,'widget-dropdown')]"
                                "[label[normalize-space()='ZeRO stage']]//select")
    Select(stage).select_by_visible_text(value)


def take_the_json(driver, check: Check, port: int, downloads: Path) -> None:
    """'download ds_config.json' saves the config the details show; 'copy JSON' puts it on the clipboard."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By

    shown = json_text(driver)
    expected = json.loads(shown[shown.index("\n{") + 1:]) if "\n{" in shown else None
    for old in downloads.glob("ds_config*.json"):
        old.unlink()
    driver.find_element(By.CSS_SELECTOR, ".ds-planner a.ds-plan-download").click()
    try:
        wait(driver, lambda d: (downloads / "ds_config.json").is_file(), 20, "ds_config.json downloaded")
        time.sleep(0.5)
        saved = json.loads((downloads / "ds_config.json").read_text())
        check(expected is not None and saved == expected, "'download ds_config.json' saves the JSON the plan shows "
              f"(train_micro_batch_size_per_gpu {saved.get('train_micro_batch_size_per_gpu')})")
    except (TimeoutException, ValueError) as exc:
        check(False, f"'download ds_config.json' saves the JSON the plan shows ({type(exc).__name__})")
    driver.execute_cdp_cmd("Browser.grantPermissions", {"origin": f"http://127.0.0.1:{port}",
                                                        "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    button = driver.find_element(By.CSS_SELECTOR, ".ds-planner button.ds-plan-copy")
    button.click()
    try:
        wait(driver, lambda d: d.execute_script(
            "const b = document.querySelector('.ds-planner button.ds-plan-copy'); return b && b.textContent !== "
            "'copy JSON' ? b.textContent : false;"), 10, "the copy button's answer")
        pasted = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "navigator.clipboard.readText().then(done, e => done('read failed: ' + e));")
        answer = driver.execute_script("return document.querySelector('.ds-planner button.ds-plan-copy').textContent;")
        check(answer == "copied" and expected is not None and pasted.startswith("{") and json.loads(pasted) == expected,
              f"'copy JSON' puts the plan's JSON on the clipboard ({answer!r}, {pasted[:40]!r})")
    except TimeoutException:
        check(False, "'copy JSON' answers (copied, or says to use download)")


def unreachable_hub_id(driver, check: Check, model, out: Path = OUT) -> None:
    """A Hub id the (silent) Hub never answers for: 'looking up ...', then its error in the widget, in seconds."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.keys import Keys

    model.send_keys(Keys.CONTROL, "a")
    model.send_keys(Keys.DELETE)
    model.send_keys("some-org/some-model", Keys.ENTER)
    started = time.time()
    seen_lookup = False
    try:
        def answered(d) -> bool:
            nonlocal seen_lookup
            text = verdict_text(d)
            seen_lookup = seen_lookup or "looking up" in text
            return "cannot plan" in text

        wait(driver, answered, 30, "the Hub lookup's error")
        took = time.time() - started
        text = verdict_text(driver)
        check("could not reach the Hugging Face Hub" in text and took < 12,
              f"an unanswered Hub lookup fails in the widget in {took:.1f} s (looking up shown: {seen_lookup}): "
              f"{text[:110]!r}")
    except TimeoutException:
        check(False, f"an unanswered Hub lookup fails in the widget (verdict {verdict_text(driver)[:100]!r})")
    shot(driver, "05_hub_lookup_error.png", out)


def drive_planner(driver, check: Check, first: str, port: int, downloads: Path, out: Path = OUT,
                  where: str = "") -> None:
    """The live planner after the notebook ran (its verdict `first`): the model field re-plans on Enter and not while
    typing, stage 3 and micro-batch 16 change the plan, the JSON can be taken, an unanswered Hub id fails in the widget,
    then back at gpt2-medium (ZeRO-3) with the static copy following, hidden. Check names start with `where`."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    # 1. the model field: typing does not re-plan; Enter does
    model = driver.find_element(By.XPATH, PLANNER + "//div[label[normalize-space()='model']]//input")
    model.send_keys(Keys.CONTROL, "a")
    model.send_keys(Keys.DELETE)
    model.send_keys("gpt2-medium")
    time.sleep(2)
    check(verdict_text(driver) == first, f"{where}typing a model name does not re-plan before Enter")
    picture = planner_state(driver)["src"]
    model.send_keys(Keys.ENTER)
    try:
        wait(driver, lambda d: verdict_text(d) != first and "gpt2-medium" in verdict_text(d), 30,
             "the verdict for gpt2-medium")
        check(True, f"{where}Enter re-plans: {verdict_text(driver)[:120]!r}")
        wait(driver, lambda d: planner_state(d)["src"] != picture, 10, "a new picture")
        check(True, f"{where}the picture follows the plan")
    except TimeoutException:
        check(False, f"{where}Enter re-plans and redraws (verdict {verdict_text(driver)[:120]!r})")
    shot(driver, "02_model_gpt2-medium.png", out)

    # 2. ZeRO stage 3 from its dropdown
    before, before_json = verdict_text(driver), json_text(driver)
    select_stage(driver, "3")
    try:
        wait(driver, lambda d: "ZeRO-3" in verdict_text(d), 30, "a ZeRO-3 verdict")
        check(verdict_text(driver) != before and json_text(driver) != before_json,
              f"{where}stage 3 changes the plan: {verdict_text(driver)[:120]!r}")
    except TimeoutException:
        check(False, f"{where}stage 3 changes the plan (verdict still {verdict_text(driver)[:120]!r})")
    shot(driver, "03_stage_3.png", out)

    # 3. an exact micro-batch: 16, typed, then Enter; on a runtime without a GPU its activations are in RAM: the
    # verdict's RAM total moves with it (issue 23, item 4)
    before_json, before_verdict = json_text(driver), verdict_text(driver)
    type_micro_batch(driver, 16)
    try:
        wait(driver, lambda d: '"train_micro_batch_size_per_gpu": 16' in json_text(d), 30,
             "micro-batch 16 in the JSON")
        check(json_text(driver) != before_json, f"{where}micro-batch 16 (exact) reaches the DeepSpeed JSON")
        if "no GPU" in before_verdict:
            ram = ram_needed(before_verdict), ram_needed(verdict_text(driver))
            check(None not in ram and ram[1] > ram[0], f"{where}on this runtime without a GPU, micro-batch 4 -> 16 "
                  f"raises the verdict's RAM total: {ram[0]} -> {ram[1]} GB ({verdict_text(driver)[:110]!r})")
    except TimeoutException:
        check(False, f"{where}micro-batch 16 (exact) reaches the DeepSpeed JSON")
    take_the_json(driver, check, port, downloads)
    heads = driver.find_elements(By.XPATH, PLANNER + "//*[contains(@class,'jupyter-widget-Collapse-header') "
                                 "or contains(@class,'p-Collapse-header')]")
    if heads:  # open the folded details for the picture
        heads[0].click()
        time.sleep(1)
    shot(driver, "04_micro_batch_16_details_open.png", out)
    if heads:
        heads[0].click()
        time.sleep(0.5)
    micro_batch_2000(driver, check, out, where)  # ends back at micro-batch 16

    # 4. a Hub id that cannot be looked up, then back to the last plan for the saved copy
    unreachable_hub_id(driver, check, model, out)
    model.send_keys(Keys.CONTROL, "a")
    model.send_keys(Keys.DELETE)
    model.send_keys("gpt2-medium", Keys.ENTER)
    wait(driver, lambda d: verdict_text(d).startswith("fits gpt2-medium"), 30, "the gpt2-medium plan again")

    # 5. restart-safe: a static copy of the last plan, kept up to date and hidden while the widget lives
    copy_state = driver.execute_script(
        "const s = document.querySelector('.ds-plan-static');"
        "return s ? [getComputedStyle(s).display, s.textContent.slice(0, 300)] : ['missing', ''];")
    check(copy_state[0] == "none" and "fits gpt2-medium" in copy_state[1],
          f"{where}the static copy follows the plan and is hidden beside the live widget ({copy_state[0]})")


def ram_needed(verdict: str) -> float | None:
    """The RAM (GB) a verdict line says the plan needs: 'RAM 13.78 / 25.28 GB' (fits) or 'CPU RAM: needs ~797.19 GB'
    (does not fit); None when it names none."""
    found = re.search(r"RAM ([\d.]+) / [\d.]+ GB", verdict) or re.search(r"RAM: needs ~([\d.]+) GB", verdict)
    return float(found.group(1)) if found else None


def micro_batch_field(driver):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.XPATH, PLANNER + "//div[label[normalize-space()='micro-batch']]//input")


def type_micro_batch(driver, value: int) -> None:
    """Replace the planner's micro-batch with `value`, typed, then Enter (the caller waits for the plan)."""
    from selenium.webdriver.common.keys import Keys

    mb = micro_batch_field(driver)
    mb.send_keys(Keys.CONTROL, "a")
    mb.send_keys(str(value), Keys.ENTER)


def select_control(driver, label: str, value: str) -> None:
    """Pick `value` in the planner's dropdown labelled `label` ('ZeRO stage', 'param offload', ...)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    field = driver.find_element(By.XPATH, PLANNER + "//div[contains(@class,'widget-dropdown')]"
                                f"[label[normalize-space()='{label}']]//select")
    Select(field).select_by_visible_text(value)


def apply_button(driver) -> dict:
    """The verdict's apply button as shown: its label, and whether the label is cut (a one-line label wider than the
    button) or wraps."""
    return driver.execute_script("""
        const b = document.querySelector('.ds-planner .ds-plan-apply');
        if (!b) return {shown: false, text: ''};
        const r = b.getBoundingClientRect(), p = b.closest('.ds-planner').getBoundingClientRect();
        const tops = [];  // the label's line boxes (its text, not the icon)
        for (const t of [...b.childNodes].filter(n => n.nodeType === 3 && n.textContent.trim())) {
            const range = document.createRange();
            range.selectNodeContents(t);
            tops.push(...[...range.getClientRects()].filter(q => q.width > 0).map(q => Math.round(q.top)));
        }
        const lines = new Set(tops).size;
        return {shown: !!b.offsetParent && r.width > 0, text: b.textContent.trim(), scroll_w: b.scrollWidth,
                client_w: b.clientWidth, height: Math.round(r.height), text_lines: lines,
                white_space: getComputedStyle(b).whiteSpace, inside: r.right <= p.right + 1 && r.left >= p.left - 1};""")


def click_apply(driver) -> None:
    from selenium.webdriver.common.by import By

    button = driver.find_element(By.CSS_SELECTOR, ".ds-planner .ds-plan-apply")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    time.sleep(0.3)
    button.click()


def micro_batch_2000(driver, check: Check, out: Path, where: str) -> None:
    """A micro-batch of 2000 typed: the field and the plan keep 2000 (no silent cap at 1024, issue 23 item 4), the
    verdict's RAM total grows, and its apply button proposes a smaller micro-batch, which fits; then back to 16."""
    from selenium.common.exceptions import TimeoutException

    before = verdict_text(driver)
    type_micro_batch(driver, 2000)
    try:
        wait(driver, lambda d: '"train_micro_batch_size_per_gpu": 2000' in json_text(d), 30,
             "micro-batch 2000 in the JSON")
        time.sleep(1.5)  # a clamping widget would have rewritten the field by now
        field = micro_batch_field(driver).get_attribute("value")
        ram = ram_needed(before), ram_needed(verdict_text(driver))
        check(field == "2000" and '"train_micro_batch_size_per_gpu": 2000' in json_text(driver)
              and None not in ram and ram[1] > ram[0],
              f"{where}micro-batch 2000 stays 2000 in the field ({field!r}) and in the plan's JSON; RAM "
              f"{ram[0]} -> {ram[1]} GB: {verdict_text(driver)[:110]!r}")
        shot(driver, "04b_micro_batch_2000.png", out)
        button = apply_button(driver)
        if "does NOT fit" in verdict_text(driver):
            check(button["shown"] and "micro-batch" in button["text"],
                  f"{where}at micro-batch 2000 the apply button proposes a smaller micro-batch: {button['text']!r}")
            if button["shown"]:
                click_apply(driver)
                wait(driver, lambda d: '"train_micro_batch_size_per_gpu": 2000' not in json_text(d)
                     and verdict_text(d).startswith(("fits", "does NOT fit", "config refused")), 30,
                     "the applied micro-batch")
                applied = re.search(r'"train_micro_batch_size_per_gpu": (\d+)', json_text(driver))
                check(verdict_text(driver).startswith("fits") and applied is not None
                      and micro_batch_field(driver).get_attribute("value") == applied.group(1),
                      f"{where}applying it gives a plan that fits, the field following "
                      f"({micro_batch_field(driver).get_attribute('value')!r}): {verdict_text(driver)[:90]!r}")
    except TimeoutException:
        check(False, f"{where}micro-batch 2000 reaches the plan (field "
              f"{micro_batch_field(driver).get_attribute('value')!r}, verdict {verdict_text(driver)[:100]!r})")
    type_micro_batch(driver, 16)
    wait(driver, lambda d: '"train_micro_batch_size_per_gpu": 16' in json_text(d)
         and verdict_text(d).startswith("fits"), 30, "micro-batch 16 again")


def chart_state(driver) -> dict:
    """The live planner's chart: the img's rendered and natural widths, its box's overflow and widths, and whether
    the box stays inside its output column."""
    return driver.execute_script("""
        const img = document.querySelector('.ds-planner img.ds-plan-picture');
        if (!img) return {found: false};
        const box = img.closest('.ds-figure-scroll') || img.parentElement;
        const col = img.closest('.jp-OutputArea-output, .output_subarea, .ds-planner');
        const r = img.getBoundingClientRect(), b = box.getBoundingClientRect(), c = col.getBoundingClientRect();
        // the box and its ancestors up to the column: width, display, min-width, overflow-x (where the chart's
        // width escapes its box)
        const chain = [];
        for (let e = box; e && e !== col.parentElement; e = e.parentElement)
            chain.push(`${e.tagName.toLowerCase()}.${[...e.classList].slice(0, 3).join('.')} ${Math.round(
                e.getBoundingClientRect().width)}px ${getComputedStyle(e).display} min-width:${getComputedStyle(e)
                .minWidth} overflow-x:${getComputedStyle(e).overflowX}`);
        const scroller = (() => { for (let e = box; e; e = e.parentElement) if (e.scrollWidth > e.clientWidth + 1
            && /auto|scroll/.test(getComputedStyle(e).overflowX)) return `${e.tagName.toLowerCase()}.${[...e.classList]
            .slice(0, 2).join('.')} (${e.clientWidth}px showing ${e.scrollWidth}px)`; return ''; })();
        return {found: true, chain: chain, scrolls: scroller,
                loaded: img.complete && img.naturalWidth > 0, rendered_w: Math.round(r.width),
                natural_w: img.naturalWidth, dpr: window.devicePixelRatio, overflow_x: getComputedStyle(box).overflowX,
                box_client_w: box.clientWidth, box_scroll_w: box.scrollWidth, box_right: Math.round(b.right),
                column_right: Math.round(c.right), window_w: window.innerWidth};""")


def narrow_column(driver, check: Check, out: Path, where: str, width: int, height: int, lab: bool) -> None:
    """The browser at 900 px (JupyterLab: with the file browser open): the chart at its own pixel size in a box that
    scrolls sideways, not shrunk (issue 23, item 5); a refused combination (ZeRO stage 0 with parameter offload) gets
    an apply button whose label is not cut, and applying it gives a plan that is not refused (item 4). Then back to
    ZeRO-3 without offload, the window at `width`."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.set_window_size(900, height)
    if lab:
        driver.execute_script("window.jupyterapp.commands.execute('filebrowser:activate');")
    time.sleep(3)
    browser_w = driver.execute_script(
        "const f = document.querySelector('.jp-FileBrowser'); return f && f.offsetParent ? f.offsetWidth : 0;")
    chart = chart_state(driver)
    chain = chart.pop("chain", [])
    check(chart.get("found") and chart["loaded"] and chart["rendered_w"] >= chart["natural_w"] / chart["dpr"] - 1,
          f"{where}at 900 px" + (f" with the file browser open ({browser_w} px)" if lab else "") + ", the chart is "
          f"shown at its own size, not shrunk: {chart.get('rendered_w')} px of {chart.get('natural_w')}")
    own_box = (chart.get("found") and chart["overflow_x"] in ("auto", "scroll")
               and chart["box_right"] <= chart["column_right"] + 1
               and (chart["box_scroll_w"] > chart["box_client_w"] or chart["box_client_w"] >= chart["rendered_w"]))
    check(own_box, f"{where}at 900 px the chart's own box (.ds-figure-scroll) stays in the output column and scrolls "
          f"sideways: {chart}")
    if not own_box:  # where the width escapes, and what a learner scrolls instead
        print("     the chart's box and its ancestors:\n       " + "\n       ".join(chain), flush=True)
        trial = driver.execute_script(  # would `min-width: 0` on the picture's widget let its box scroll?
            "const st = document.createElement('style'); st.id = 'ds-trial'; st.textContent = '.ds-planner "
            ".widget-html:has(.ds-figure-scroll), .ds-planner .widget-html-content:has(> .ds-figure-scroll) "
            "{min-width: 0}'; document.head.appendChild(st); const b = document.querySelector('.ds-planner "
            ".ds-figure-scroll'); const c = b.closest('.jp-OutputArea-output, .output_subarea');"
            "const out = {box_client_w: b.clientWidth, box_scroll_w: b.scrollWidth, box_right: Math.round("
            "b.getBoundingClientRect().right), column_right: Math.round(c.getBoundingClientRect().right)};"
            "st.remove(); return out;")
        print(f"     (with `min-width: 0` on the picture's HTML widget and its content, tried here and removed: "
              f"{trial})", flush=True)
    if lab:
        check(browser_w > 100, f"{where}the file browser is open beside the notebook ({browser_w} px)")
    shot(driver, "05b_narrow_900px_chart.png", out)

    # a long apply label: gpt2-xl does not fit this runtime at ZeRO-3 (its fix names several settings)
    model = driver.find_element(By.XPATH, PLANNER + "//div[label[normalize-space()='model']]//input")
    try:
        model.send_keys(Keys.CONTROL, "a")
        model.send_keys(Keys.DELETE)
        model.send_keys("gpt2-xl", Keys.ENTER)
        wait(driver, lambda d: "gpt2-xl" in verdict_text(d), 30, "the gpt2-xl plan")
        time.sleep(1)
        button = apply_button(driver)
        if button["shown"]:
            check(button["scroll_w"] <= button["client_w"] + 1 and button["inside"],
                  f"{where}at 900 px the apply button's long label is not cut: {button}")
            shot(driver, "05b_narrow_900px_long_apply.png", out)
        else:
            print(f"     (gpt2-xl shows no apply button here: {verdict_text(driver)[:100]!r})", flush=True)
    except TimeoutException:
        check(False, f"{where}gpt2-xl re-plans at 900 px ({verdict_text(driver)[:100]!r})")
    model.send_keys(Keys.CONTROL, "a")
    model.send_keys(Keys.DELETE)
    model.send_keys("gpt2-medium", Keys.ENTER)
    wait(driver, lambda d: verdict_text(d).startswith("fits gpt2-medium"), 30, "the gpt2-medium plan again")

    before = verdict_text(driver)
    select_control(driver, "ZeRO stage", "0")
    try:
        wait(driver, lambda d: verdict_text(d) != before and "looking up" not in verdict_text(d), 30,
             "the stage 0 plan")
        select_control(driver, "param offload", "cpu")
        wait(driver, lambda d: verdict_text(d).startswith("config refused"), 30, "the refusal")
        time.sleep(1)
        button = apply_button(driver)
        check(button["shown"] and button["text"].startswith("apply"), f"{where}ZeRO stage 0 with parameter offload "
              f"is refused with an apply button: {button['text']!r} ({verdict_text(driver)[:100]!r})")
        check(button["shown"] and button["scroll_w"] <= button["client_w"] + 1 and button["inside"],
              f"{where}at 900 px the apply button's label is not cut: {button}")
        shot(driver, "05c_narrow_900px_refused_apply.png", out)
        if button["shown"]:
            click_apply(driver)
            wait(driver, lambda d: not verdict_text(d).startswith("config refused")
                 and verdict_text(d).startswith(("fits", "does NOT fit")), 30, "a plan after applying the fix")
            text = verdict_text(driver)
            check(not text.startswith("config refused") and "ZeRO-3" in text,
                  f"{where}applying the fix gives a plan that is not refused: {text[:110]!r}")
            shot(driver, "05d_refusal_fix_applied.png", out)
    except TimeoutException as exc:
        check(False, f"{where}a refused combination gets an apply that fixes it ({exc.msg}; verdict "
              f"{verdict_text(driver)[:110]!r})")
    # back to ZeRO-3 without offload (the plan the rest expects)
    select_control(driver, "ZeRO stage", "3")
    time.sleep(1)
    select_control(driver, "param offload", "none")
    wait(driver, lambda d: verdict_text(d).startswith("fits gpt2-medium") and "ZeRO-3" in verdict_text(d)
         and '"train_micro_batch_size_per_gpu": 16' in json_text(d), 30, "the gpt2-medium ZeRO-3 plan again")
    if lab:
        driver.execute_script("window.jupyterapp.shell.collapseLeft();")
    driver.set_window_size(width, height)
    time.sleep(1)


def restarted_state(driver) -> dict:
    """The planner's output after its kernel restarted: the static copy and its banner, the live planner (hidden, or
    greyed and refusing the pointer), its classes."""
    return driver.execute_script("""
        const shown = e => !!(e && e.offsetParent && e.getClientRects().length);
        const s = document.querySelector('.ds-plan-static'), banner = s && s.querySelector('.ds-plan-rerun');
        const p = document.querySelector('.ds-planner');
        const field = p && p.querySelector('input, select');
        let hit = null;
        if (shown(field)) {
            field.scrollIntoView({block: 'center'});
            const r = field.getBoundingClientRect();
            const at = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
            hit = at === field || field.contains(at);
        }
        const after = p ? getComputedStyle(p, '::after').content : '';
        return {banner: shown(banner) ? banner.textContent.trim().slice(0, 160) : '', static_shown: shown(s),
                planner: !!p, planner_shown: shown(p), disconnected: !!(p && p.classList.contains(
                'jupyter-widgets-disconnected')), pointer_events: p ? getComputedStyle(p).pointerEvents : '',
                opacity: p ? getComputedStyle(p).opacity : '', control_takes_clicks: hit,
                note_after: after && after !== 'none' ? after.slice(0, 80) : '',
                live_verdict_shown: shown(p && p.querySelector('.ds-plan-verdict'))};""")


def restart_kernel(driver, check: Check, out: Path, where: str, classic: bool, name: str) -> None:
    """Restart the kernel as the Kernel menu does (no dialog): the planner stays on the page with a dead comm. The
    banner "Re-run this cell for the live planner" shows (the static copy), the dead controls are hidden, or greyed
    and not taking clicks, and no live-looking verdict pretends to follow them (issue 23, item 5)."""
    from selenium.common.exceptions import TimeoutException

    driver.set_script_timeout(120)
    if classic:
        driver.execute_script("Jupyter.notebook.kernel.restart();")
    else:
        driver.execute_script("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart();")
    try:
        time.sleep(3)
        wait(driver, classic_kernel_idle if classic else kernel_idle, 120, "the restarted kernel")
        wait(driver, lambda d: restarted_state(d)["banner"], 20, "the re-run banner")
    except TimeoutException:
        pass
    time.sleep(2)
    state = restarted_state(driver)
    check("Re-run this cell for the live planner" in state["banner"] and state["static_shown"],
          f"{where}after a kernel restart the banner shows: {state['banner'][:90]!r}")
    dead = (not state["planner_shown"]) or (state["pointer_events"] == "none" and float(state["opacity"] or 1) < 1
                                            and state["control_takes_clicks"] is False)
    check(state["planner"] and dead, f"{where}after a kernel restart the dead controls are hidden, or greyed and not "
          f"taking clicks: {state}")
    check(not state["live_verdict_shown"] or "Re-run" in state["note_after"],
          f"{where}after a kernel restart no live verdict pretends to follow the controls (live verdict shown: "
          f"{state['live_verdict_shown']}, note: {state['note_after']!r})")
    driver.execute_script("const s = document.querySelector('.ds-plan-static');"
                          "if (s) s.scrollIntoView({block: 'start'}); return !!s;")
    time.sleep(0.5)
    path = out / name
    driver.save_screenshot(str(path))
    print(f"     screenshot {path.relative_to(ROOT)}", flush=True)


def lab_part(driver, args: argparse.Namespace, check: Check, base: str, port: int, copy: Path,
             downloads: Path) -> None:
    """Notebook 00 in JupyterLab: run all, drive the planner, take the JSON, reopen without the kernel."""
    started = time.time()
    driver.get(f"{base}/lab/tree/{copy.relative_to(ROOT).as_posix()}")
    wait(driver, kernel_idle, 120, "the notebook's kernel to be idle")
    print(f"     notebook open, kernel idle after {time.time() - started:.0f} s; running all cells", flush=True)
    run_all_and_wait(driver, args.timeout)
    print(f"     notebook ran in {time.time() - started:.0f} s", flush=True)
    errors = driver.execute_script(
        "return [...document.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent)"
        ".filter(t => /Traceback|Error displaying widget/.test(t)).map(t => t.slice(0, 300));")
    check(not errors, "no traceback or 'Error displaying widget' in the outputs" + (f": {errors}" if errors else ""))
    first = verdict_text(driver)
    check(("fit" in first or "cannot plan" in first) and PLAN_MODEL_HINT in first,
          f"the planner starts at the notebook's model with a verdict: {first[:120]!r}")
    check_dashboard(driver, check, "JupyterLab")
    shot(driver, "01_planner_after_run_all.png")

    drive_planner(driver, check, first, port, downloads)
    narrow_column(driver, check, OUT, "JupyterLab: ", args.width, args.height, lab=True)
    driver.execute_script("window.jupyterapp.commands.execute('docmanager:save');")  # the outputs, for what follows
    time.sleep(3)


def lab_reopened(driver, check: Check, base: str, copy: Path, expect: tuple[str, ...]) -> None:
    """Notebook 00 reopened in JupyterLab after its kernel was shut down: the static copy, no widget error."""
    driver.get(f"{base}/lab/tree/{copy.relative_to(ROOT).as_posix()}")
    reopen_without_kernel(driver, check, "JupyterLab", expect, reload_only=True)
    driver.save_screenshot(str(OUT / "06_reopened_without_kernel.png"))


def notebook7_part(driver, check: Check, base: str, copy: Path) -> None:
    """The same notebook in Notebook 7, on the kernel JupyterLab left running: the live planner restored from it
    with its picture and uncut labels, a stage change re-plans; then saved, shut down and reopened there."""
    from selenium.common.exceptions import TimeoutException

    driver.get(f"{base}/notebooks/{copy.relative_to(ROOT).as_posix()}")
    wait(driver, kernel_idle, 120, "Notebook 7 on the notebook's kernel")
    wait(driver, lambda d: verdict_text(d).startswith("fits gpt2-medium"), 60, "the live planner in Notebook 7")
    check(True, f"Notebook 7: the live planner is restored from the kernel: {verdict_text(driver)[:80]!r}")
    time.sleep(1)
    check_dashboard(driver, check, "Notebook 7")
    select_stage(driver, "2")
    try:
        wait(driver, lambda d: "ZeRO-2" in verdict_text(d), 30, "a ZeRO-2 verdict in Notebook 7")
        check(True, f"Notebook 7: stage 2 re-plans: {verdict_text(driver)[:80]!r}")
    except TimeoutException:
        check(False, f"Notebook 7: stage 2 re-plans (verdict still {verdict_text(driver)[:100]!r})")
    shot(driver, "07_notebook7_planner.png")
    restart_kernel(driver, check, OUT, "Notebook 7: ", False, "07b_notebook7_kernel_restarted.png")
    # the static copy is updated through its display id, which a page loaded later does not know: it keeps the last
    # plan of the page that ran the cell (ZeRO-3), not Notebook 7's change (ZeRO-2), until the cell is run again
    reopen_without_kernel(driver, check, "Notebook 7", ("gpt2-medium", "ZeRO-3"))
    driver.save_screenshot(str(OUT / "08_notebook7_reopened.png"))


def workspace(out: Path) -> tuple[Path, Path]:
    """A fresh copy of notebook 00 under `out`/nb (the front ends autosave it) and the browser's downloads folder."""
    nb_dir, downloads = out / "nb", out / "downloads"
    nb_dir.mkdir(parents=True, exist_ok=True)
    downloads.mkdir(exist_ok=True)
    copy = nb_dir / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    return copy, downloads


def run(args: argparse.Namespace) -> int:
    copy, downloads = workspace(OUT)
    hub = silent_hub()
    token, port = secrets.token_hex(16), free_port()
    lab = start_lab(port, token, f"http://127.0.0.1:{hub.getsockname()[1]}")
    driver = None
    check = Check()
    started = time.time()
    try:
        wait_for_server(port, token)
        driver = browser(args.width, args.height, downloads)
        base = f"http://127.0.0.1:{port}"
        driver.get(f"{base}/lab?token={token}")  # logs in (a cookie): the pages below need no token
        lab_part(driver, args, check, base, port, copy, downloads)
        if args.skip_notebook7:
            restart_kernel(driver, check, OUT, "JupyterLab: ", False, "05e_kernel_restarted.png")
            reopen_without_kernel(driver, check, "JupyterLab", ("gpt2-medium", "ZeRO-3"))
            driver.save_screenshot(str(OUT / "06_reopened_without_kernel.png"))
        else:
            notebook7_part(driver, check, base, copy)  # ends with the kernel shut down
            lab_reopened(driver, check, base, copy, ("gpt2-medium", "ZeRO-3"))
    except Exception as exc:  # the reason, and a picture of where it stopped
        check(False, f"{type(exc).__name__}: {str(exc)[:500]}")
        if driver is not None:
            shot(driver, "99_failure.png")
    finally:
        stop(driver, lab, hub)
    return verdict(check, started, "", OUT)


def stop(driver, server: subprocess.Popen, hub) -> None:
    """Close the browser, the Jupyter server (killed after 20 s) and the silent Hub."""
    if driver is not None:
        driver.quit()
    server.terminate()
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        server.kill()
    hub.close()


def verdict(check: Check, started: float, what: str, out: Path) -> int:
    """Print PASSED/FAILED with the seconds and where the screenshots are; the exit status."""
    print(f"{'PASSED' if not check.failures else 'FAILED'}{what} in {time.time() - started:.0f} s; screenshots in "
          f"{out.relative_to(ROOT)}/", flush=True)
    return 0 if not check.failures else 1


# ------------------------------------------------------------------ classic Notebook 6 with Colab's widgets (issue 21)

CLASSIC_ENV = ROOT / "build" / "colab-widgets-env"
CLASSIC_OUT = OUT / "classic"
# what a widget that cannot be shown reads: JupyterLab's words, and ipywidgets 7's in classic Notebook
WIDGET_ERROR = r"Error displaying widget|Error rendering Jupyter widget|widget could not be displayed|Loading widget"


def start_classic(env: Path, port: int, token: str, hub_endpoint: str) -> subprocess.Popen:
    """Classic Notebook of `env` (notebook 6.5.7 with widgetsnbextension 3.6.10, Colab's versions) serving ROOT. Its
    python3 kernel runs the server's interpreter, so the notebook runs on `env`'s ipywidgets 7.7.1 and ipykernel;
    `env`'s bin comes first on PATH (the programs the notebook starts), and its op builds go to their own folder."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("DS_COURSE_SAVED_RUN", "PYTHONPATH")}
    run_env.update(HF_ENDPOINT=hub_endpoint, VIRTUAL_ENV=str(env), PATH=f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}",
                   TORCH_EXTENSIONS_DIR=str(ROOT / "build" / "torch_ext_colab"))
    log = open(CLASSIC_OUT / "notebook.log", "w")
    return subprocess.Popen(
        [str(env / "bin" / "python"), "-m", "notebook", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--NotebookApp.token={token}", f"--NotebookApp.notebook_dir={ROOT}",
         *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
        cwd=ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT)


def classic_kernel_idle(driver) -> bool:
    """Classic Notebook's kernel is connected and its indicator says idle."""
    return driver.execute_script(
        "const n = window.Jupyter && Jupyter.notebook; return !!(n && n.kernel && n.kernel.is_connected()"
        " && document.querySelector('#kernel_indicator_icon.kernel_idle_icon'));")


def classic_kernel_says(driver, code: str) -> str:
    """What `code` prints in the classic notebook's kernel (not stored in its history)."""
    driver.set_script_timeout(60)
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1]; let out = '';"
        "Jupyter.notebook.kernel.execute(arguments[0], {iopub: {output: m => { out += m.content.text || ''; }},"
        " shell: {reply: () => setTimeout(() => done(out), 500)}}, {silent: false, store_history: false});", code)


def classic_outputs(driver) -> list[dict]:
    """Every output a learner sees in classic Notebook (hidden ones have no offsetParent), with its cell's first
    characters."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.output_area')].filter(o => o.offsetParent).map(o => ({"
        "text: o.textContent.trim(), cell: ((o.closest('.cell') || o).querySelector('.input_area') || o)"
        ".textContent.slice(0, 80)}));")


def training_bar(driver) -> dict:
    """notebook 00's training bar (tqdm, desc 'training') as the page shows it: its text lines, and whether a
    progress widget is still in that cell's output."""
    return driver.execute_script(r"""
        const cell = [...document.querySelectorAll('.code_cell')].find(c => /desc="training"/.test(
            (c.querySelector('.input_area') || c).textContent));
        if (!cell) return {found: false, lines: [], widget: false};
        const outs = [...cell.querySelectorAll('.output_area')].filter(o => o.offsetParent);
        return {found: true, lines: outs.map(o => o.textContent.trim()).filter(t => /training:/.test(t))
                .map(t => t.slice(0, 120)), widget: !!cell.querySelector('.widget-hprogress, .widget-progress')};""")


def check_training_bar(driver, check: Check, where: str) -> None:
    """The finished bar is its final line of text (100 %, 40/40 on the CPU), not 0 %, not nothing, no widget."""
    bar = training_bar(driver)
    final = [t for t in bar["lines"] if re.search(r"training:\s*100%", t)]
    check(bar["found"] and len(bar["lines"]) == 1 and final and not bar["widget"] and not [
        t for t in bar["lines"] if re.search(r"training:\s*0%", t)],
        f"{where}: the finished training bar shows its final text in place: {bar['lines']} "
        f"(widget left: {bar['widget']})")
    driver.execute_script(  # the bar's line in the middle of the screenshot
        "const c = [...document.querySelectorAll('.code_cell')].find(c => /desc=\"training\"/.test("
        "(c.querySelector('.input_area') || c).textContent)); const o = c && [...c.querySelectorAll('.output_area')]"
        ".find(o => /training:/.test(o.textContent)); if (o || c) (o || c).scrollIntoView({block: 'center'});")
    time.sleep(0.5)


def control_gaps(driver) -> list[float]:
    """Horizontal space (px) between neighbouring controls on the same line of the planner's two rows."""
    return driver.execute_script("""
        const gaps = [];
        for (const row of document.querySelectorAll('.ds-planner .widget-hbox')) {
            const kids = [...row.children].filter(k => k.offsetParent).map(k => k.getBoundingClientRect());
            for (let i = 1; i < kids.length; i++)
                if (Math.abs(kids[i].top - kids[i - 1].top) < 4) gaps.push(kids[i].left - kids[i - 1].right);
        }
        return gaps;""")


def classic_part(driver, args: argparse.Namespace, check: Check, base: str, port: int, copy: Path,
                 downloads: Path) -> None:
    """Notebook 00 in classic Notebook on Colab's widgets: run all, the training bar, drive the planner."""
    from selenium.webdriver.common.by import By

    started = time.time()
    driver.get(f"{base}/notebooks/{copy.relative_to(ROOT).as_posix()}")
    wait(driver, classic_kernel_idle, 120, "the classic notebook's kernel to be idle")
    says = classic_kernel_says(driver, "import sys, ipywidgets, IPython, ipykernel\n"
                                       "print(sys.prefix, ipywidgets.__version__, IPython.__version__, ipykernel.__version__)")
    words = says.split()
    check(len(words) == 4 and Path(words[0]).resolve() == args.env and words[1] == "7.7.1", f"classic Notebook: the kernel is the Colab-versions venv's, "
          f"with ipywidgets 7.7.1 (prefix, ipywidgets, IPython, ipykernel: {says.strip()!r})")
    print(f"     notebook open, kernel idle after {time.time() - started:.0f} s; running all cells", flush=True)
    driver.execute_script("Jupyter.notebook.execute_all_cells();")
    wait(driver, lambda d: d.find_elements(By.XPATH, PLANNER + "//div[contains(@class,'ds-plan-verdict')]"),
         args.timeout, "the planner's verdict line")
    wait(driver, lambda d: d.execute_script(
        "return Jupyter.notebook.get_cells().every(c => c.cell_type !== 'code' || c.input_prompt_number !== '*')"
        " && !!document.querySelector('#kernel_indicator_icon.kernel_idle_icon');"), args.timeout,
         "every cell to finish")
    print(f"     notebook ran in {time.time() - started:.0f} s", flush=True)
    errors = [f"{o['text'][:300]} (cell: {o['cell']})" for o in classic_outputs(driver)
              if re.search("Traceback|" + WIDGET_ERROR, o["text"])]
    check(not errors, "classic Notebook: no traceback or widget error in the outputs" + (f": {errors}" if errors
                                                                                        else ""))
    check_training_bar(driver, check, "classic Notebook")
    shot_plain(driver, "00_training_bar_finished.png")
    first = verdict_text(driver)
    check(("fit" in first or "cannot plan" in first) and PLAN_MODEL_HINT in first,
          f"classic Notebook: the planner starts at the notebook's model with a verdict: {first[:120]!r}")
    check_dashboard(driver, check, "classic Notebook")
    gaps = control_gaps(driver)
    check(len(gaps) >= 4 and min(gaps) >= 8, f"classic Notebook: the planner's controls are spaced (px between "
          f"neighbours: {[round(g) for g in gaps]})")
    shot(driver, "01_planner_after_run_all.png", CLASSIC_OUT)
    drive_planner(driver, check, first, port, downloads, CLASSIC_OUT, "classic Notebook: ")
    narrow_column(driver, check, CLASSIC_OUT, "classic Notebook: ", args.width, args.height, lab=False)
    restart_kernel(driver, check, CLASSIC_OUT, "classic Notebook: ", True, "05e_kernel_restarted.png")


def shot_plain(driver, name: str) -> None:
    """A screenshot of the page as it is scrolled now (shot() scrolls to the planner)."""
    driver.save_screenshot(str(CLASSIC_OUT / name))
    print(f"     screenshot {(CLASSIC_OUT / name).relative_to(ROOT)}", flush=True)


def classic_reopened(driver, check: Check, base: str, copy: Path, expect: tuple[str, ...]) -> None:
    """Saved, the kernel shut down, the page reloaded (classic Notebook starts a new kernel, which has none of the
    old widgets): the training bar's final text and the planner's static copy show, and no widget error nor the
    widget's text fallback (`VBox(children=...`) does."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By

    driver.set_script_timeout(60)
    saved = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "Jupyter.notebook.save_notebook().then(() => done(true), e => done('save failed: ' + e));")
    check(saved is True, f"classic Notebook: the notebook is saved ({saved})")
    time.sleep(1)
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "Jupyter.notebook.session.delete(() => done(true), () => done(false));")
    time.sleep(2)
    driver.get(f"{base}/notebooks/{copy.relative_to(ROOT).as_posix()}")
    where = "classic Notebook, reopened"
    try:
        wait(driver, lambda d: static_copy_state(d)["shown"], 120, "the static copy in the reopened notebook")
        wait(driver, classic_kernel_idle, 120, "the reopened notebook's new kernel")
        time.sleep(3)  # the widget manager has given up on the saved widgets by now
        state = static_copy_state(driver)
        check("re-run this cell" in state["text"].lower() and all(e in state["text"] for e in expect) and state["picture"]
              and state["download"], f"{where}: the notebook shows the last plan, its picture and the download "
              f"link: {state['text'][:100]!r}")
    except TimeoutException:
        check(False, f"{where}: the notebook shows the planner's static copy")
    outputs = classic_outputs(driver)
    errors = [f"{o['text'][:120]} (cell: {o['cell']})" for o in outputs if re.search(WIDGET_ERROR, o["text"])]
    check(not errors, f"{where}: no widget error anywhere" + (f": {errors}" if errors else ""))
    shown = driver.execute_script(  # the planner cell's visible outputs: its static copy, nothing else
        "const c = [...document.querySelectorAll('.code_cell')].find(c => /planner_widget\\(/.test("
        "(c.querySelector('.input_area') || c).textContent)); return c ? [...c.querySelectorAll('.output_area')]"
        ".filter(o => o.offsetParent).map(o => (o.querySelector('.ds-plan-static') ? 'static copy: ' : '')"
        " + o.textContent.trim().slice(0, 80)) : [];")
    check(len(shown) == 1 and shown[0].startswith("static copy: "), f"{where}: the planner's cell shows its static "
          f"copy and nothing else (no widget error, no `VBox(children=...` text): {shown}")
    statics = driver.find_elements(By.CLASS_NAME, "ds-plan-static")
    if statics:
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", statics[0])
        time.sleep(0.5)
    shot_plain(driver, "06_reopened_planner_static_copy.png")
    check_training_bar(driver, check, where)
    shot_plain(driver, "07_reopened_training_bar.png")


def run_classic(args: argparse.Namespace) -> int:
    """Notebook 00 in classic Notebook, server and kernel from `args.env` (Colab's widget versions)."""
    args.env = args.env.resolve()
    if not (args.env / "bin" / "python").is_file():
        print(f"no venv at {args.env}: build it (see this script's docstring)", flush=True)
        return 2
    copy, downloads = workspace(CLASSIC_OUT)
    hub = silent_hub()
    token, port = secrets.token_hex(16), free_port()
    server = start_classic(args.env, port, token, f"http://127.0.0.1:{hub.getsockname()[1]}")
    driver = None
    check = Check()
    started = time.time()
    try:
        wait_for_server(port, token, log=CLASSIC_OUT / "notebook.log")
        driver = browser(args.width, args.height, downloads)
        base = f"http://127.0.0.1:{port}"
        driver.get(f"{base}/tree?token={token}")  # logs in (a cookie)
        classic_part(driver, args, check, base, port, copy, downloads)
        classic_reopened(driver, check, base, copy, ("gpt2-medium", "ZeRO-3"))
    except Exception as exc:  # the reason, and a picture of where it stopped
        check(False, f"{type(exc).__name__}: {str(exc)[:500]}")
        if driver is not None:
            shot(driver, "99_failure.png", CLASSIC_OUT)
    finally:
        stop(driver, server, hub)
    return verdict(check, started, " (classic Notebook)", CLASSIC_OUT)


PLAN_MODEL_HINT = "gpt2-xl"  # notebook 00's PLAN_MODEL: the planner must start there


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for notebook 00 to run")
    parser.add_argument("--skip-notebook7", action="store_true", help="JupyterLab only")
    parser.add_argument("--classic", action="store_true", help="classic Notebook 6 on Colab's widget versions, "
                        "server and kernel from --env, instead of JupyterLab and Notebook 7")
    parser.add_argument("--env", type=Path, default=CLASSIC_ENV, help="the venv holding Colab's versions (--classic)")
    args = parser.parse_args()
    return run_classic(args) if args.classic else run(args)


if __name__ == "__main__":
    sys.exit(main())
