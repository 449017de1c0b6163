"""What the README tells a learner before they start (issue 17): prerequisites, how torch is chosen, run times, and
numbers that must be the reports' (tests/test_repo.py checks the two commands' presence and each table link)."""
import json
import re
import subprocess

from conftest import ROOT

README = (ROOT / "README.md").read_text()
SETUP = (ROOT / "scripts" / "setup.sh").read_text()
REPORT = json.loads((ROOT / "reports" / "gpu_check.json").read_text())
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _section(heading: str) -> str:
    start = README.index(heading)
    nxt = re.search(r"^#{1,3} ", README[start + len(heading):], flags=re.M)
    return README[start:start + len(heading) + nxt.start()] if nxt else README[start:]


def test_readme_names_the_prerequisites():
    pre = _section("### Prerequisites")
    assert "C++ compiler" in pre and "build-essential" in pre
    assert "python3-dev" in pre, "DeepSpeed's op builds include Python.h"
    assert "python3-venv" in pre
    assert "libaio-dev" in pre
    assert re.search(r"Disk: about \d+(\.\d+)? GB, measured", pre), "a measured disk number, said to be measured"
    # the first run compiles ops: say which and for how long
    assert "cpu_adam" in pre and "async_io" in pre and re.search(r"first run spends a few minutes", pre)


def test_readme_fenced_commands_are_exactly_the_two():
    """Stricter than test_repo's count of `bash scripts/` lines: no other command in a code block at all."""
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", README, flags=re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert commands == ["bash scripts/course.sh", "bash scripts/test.sh"], commands


def test_readme_documents_torch_index_and_the_pin_setup_uses():
    assert "TORCH_INDEX" in README and CPU_INDEX in README
    assert "${TORCH_INDEX" in SETUP and CPU_INDEX in SETUP, "the README documents what setup.sh reads"
    version = re.search(r"TORCH_VERSION=\$\{TORCH_VERSION:-([0-9.]+)\}", SETUP).group(1)
    assert f"torch=={version}" in README and "TORCH_VERSION" in README
    # one pin for CPU and GPU machines: every torch install in setup.sh asks for torch==$TORCH_VERSION
    torch_installs = [line for line in SETUP.splitlines() if re.search(r"(pip_install|install -q) \"?torch\b", line)]
    assert len(torch_installs) == 2, torch_installs  # the GPU branch and the CPU branch
    assert all('"torch==$TORCH_VERSION"' in line for line in torch_installs), torch_installs


def test_setup_installs_numpy_before_anything_imports_torch():
    numpy_install = re.search(r"(pip_install|install -q) numpy", SETUP).start()
    first_torch_import = min(m.start() for m in re.finditer(r"import torch", SETUP))
    assert numpy_install < first_torch_import, "torch started without numpy prints 'Failed to initialize NumPy'"


def test_notebook_table_durations_are_the_reports():
    """Every duration and RAM peak in the table's GPU column is reports/gpu_check.json's, and nothing else is there."""
    rows = [line for line in README.splitlines() if re.match(r"\| \d\d \| \[", line)]
    assert len(rows) == len(REPORT["notebooks"]) == 8
    for row in rows:
        cells = row.split(" | ")
        name = re.search(r"\(notebooks/(\d\d_[^)]+\.ipynb)\)", cells[1]).group(1)
        entry = REPORT["notebooks"][name]
        gpu_column = cells[-1]
        assert re.findall(r"(\d+(?:\.\d+)?) s\b", gpu_column) == [f"{entry['wall_seconds']:.0f}"], row
        assert re.findall(r"peak RAM (\d+(?:\.\d+)?) GB", gpu_column) == [f"{entry['peak_ram_gb']:.1f}"], row


def test_readme_numbers_from_the_gpu_report_are_the_reports():
    estimates = {name[:2]: e["t4_estimate"] for name, e in REPORT["notebooks"].items() if e.get("t4_estimate")}
    assert estimates
    for nn, est in estimates.items():
        assert f"{nn} {est['low_s']}-{est['high_s']} s" in README, (nn, est)
    nvme_peak = REPORT["notebooks"]["02_zero3_offload_nvme.ipynb"]["peak_nvme_folder_gb"]
    assert f"up to {nvme_peak:.1f} GB into its NVMe folder" in README
    torch_version = REPORT["torch"].split("+")[0]
    assert f"torch {torch_version} with CUDA {REPORT['torch_cuda']}" in README


def test_readme_cpu_run_time_is_one_consistent_line():
    """The one line to update after a new CPU measurement: seconds, the same in minutes, a commit and a date."""
    lines = [line for line in README.splitlines() if line.startswith("**Test command, measured:**")]
    assert len(lines) == 1, lines
    m = re.search(r"(\d+) s \((\d+(?:\.\d+)?) min\)", lines[0])
    assert m, lines[0]
    assert abs(int(m.group(1)) / 60 - float(m.group(2))) < 0.05, lines[0]
    assert re.search(r"commit [0-9a-f]{7,40}\b", lines[0]) and re.search(r"\b20\d\d-\d\d(-\d\d)?\b", lines[0])
    assert "CPU" in lines[0] and "fresh clone" in lines[0]


def test_readme_does_not_compare_the_disks():
    """The GPU machine's disk speed against Colab's was never measured: no sentence may rank them."""
    sentences = re.split(r"(?<=[.;:])\s+", README.replace("\n", " "))
    ranking = re.compile(r"\b(faster|slower|quicker|lower bound|upper bound)\b", re.I)
    bad = [s for s in sentences if "disk" in s.lower() and ranking.search(s)]
    assert not bad, bad


def test_readme_nvme_speeds_and_the_gpt2_xl_claim_are_the_reports():
    """Issue 22: the README's NVMe tokens/s and its GPT-2 XL headline are the committed measurements: notebook 02's
    NVMe configs in reports/gpu_check.json and the XL rung of the emulated ladder (RAM, CPUs, VRAM enforced)."""
    figures = REPORT["notebooks"]["02_zero3_offload_nvme.ipynb"]["figures"]
    nvme = sorted(v["tokens_per_s"] for k, v in figures.items() if "NVMe" in k and isinstance(v, dict))
    assert nvme, figures.keys()
    assert f"(774M) at {nvme[0]:.0f}-{nvme[-1]:.0f} tokens/s in notebook 02" in " ".join(README.split())
    ladder = json.loads((ROOT / "reports" / "ladder_colab_emulation.json").read_text())
    xl = next(r for r in ladder["rows"] if (r["config"], r["model"]) == ("zero3_nvme_optimizer_gpu_params", "gpt2-xl"))
    assert xl["fits"] and not xl.get("timed_out") and xl["enclosure"]["oom_kills"] == 0
    assert f"{ladder['summary']['deepspeed_over_plain']:.1f}x plain PyTorch's largest" in README
    assert f"{xl['enclosure']['peak_ram_gb']:.1f} GB of RAM at peak, {xl['tokens_per_s']:.0f} tokens/s" in README
    assert f"GPT-2 XL (1.5B) at {xl['tokens_per_s']:.0f} tokens/s alone from a fresh runtime" in " ".join(README.split())
    # issue 25: the 2.7B rung, with the chunked overflow check, its own lr, every timed step taken
    top = next(r for r in ladder["rows"] if (r["config"], r["model"]) == ("zero3_nvme_optimizer_gpu_params", "gpt2-2.7b"))
    assert top["fits"] and top["enclosure"]["oom_kills"] == 0 and top["chunked_overflow_check"]
    assert top["skipped_timed_steps"] == 0 and len(top["losses"]) >= 5
    # issue 42: whether it learns is the ladder's rule (helpers.train.loss_fell), said as the report says it; once the
    # curve is merged (ladder.py --merge-from) this phrase changes, and the message below is the README's new text
    tokens = top.get("micro_batch", ladder["settings"]["micro_batch"]) * top.get("grad_accum", 1) * ladder["settings"][
        "seq_len"]
    phrase = (f"(measured in the emulation: {top['enclosure']['peak_ram_gb']:.1f} GB of RAM at peak, "
              f"{top['tokens_per_s']:.0f} tokens/s, lr {top['lr']:g}; over its {top['steps']} optimizer steps of "
              f"{tokens:,} tokens it {'learns' if top['learns'] else 'does not learn yet'}: {top['learn_reason']})")
    assert phrase in README, (f"README's 2.7B line (How far one Colab T4 goes) should say, from "
                              f"reports/ladder_colab_emulation.json: {phrase}")


def test_readme_2p7b_speed_is_the_committed_report_and_says_it_is_speed_only():
    """Issue 42 item 2: the README's 2.7B speed at 16 x 8 is reports/offload_speed_2p7b.json's row, with its T4
    estimate, and says the row's 2 steps did not lower the loss (no 'trains' from it)."""
    report = json.loads((ROOT / "reports" / "offload_speed_2p7b.json").read_text())
    row = max(report["rows"], key=lambda r: r["tokens_per_s"])
    assert not row["fits"] and row["reason"].startswith("loss did not fall")
    assert (f"at {row['micro_batch']} x {row['grad_accum']} micro-batches per step {row['tokens_per_s']:,.0f} tokens/s "
            f"in {row['peak_rss_gb']:.2f} GB (T4 estimate {report['t4_estimate']['tokens_per_s']:.0f}; "
            f"`reports/offload_speed_2p7b.md`: {report['settings']['steps']} steps at constant lr, speed only, its loss "
            "rose)") in " ".join(README.split())


def test_readme_offload_speed_numbers_are_the_committed_report():
    """Issue 24: the README's lever-by-lever NVMe numbers are reports/offload_speed.json's rows."""
    report = json.loads((ROOT / "reports" / "offload_speed.json").read_text())
    text = " ".join(README.split())
    rows = {r["lever"]: r for r in report["rows"]}
    base, best, batch_only = report["baseline"], report["best"], report["batch_only"]
    # the summary's batch-only row is the fastest that fits with stock DeepSpeed (no patch, its own overflow check)
    assert batch_only == max(({k: r[k] for k in batch_only} for r in report["rows"] if r["fits"] and not r["patch"]
                              and not r.get("chunked_overflow_check")), key=lambda r: r["tokens_per_s"])
    assert f"{batch_only['micro_batch']} x {batch_only['grad_accum']} instead of 2 x 1" in text
    assert f"{batch_only['tokens_per_s'] / base['tokens_per_s']:.0f}x the tokens/s" in text
    assert f"{best['tokens_per_s'] / base['tokens_per_s']:.0f}x, {best['tokens_per_s']:,.0f} tokens/s, " \
           f"{best['tokens_per_s'] / best['roofline_tokens_per_s']:.0%} of what the disk alone allows" in text
    assert rows[best["lever"]]["patch"] and rows[best["lever"]]["chunked_overflow_check"]  # pinned + the course's check
    assert f"trained at {best['tokens_per_s']:,.0f} tokens/s in the emulation" in text
    assert f"the T4 estimate there, {report['t4_estimate']['tokens_per_s']:,.0f} tokens/s" in text
    own, chunked = rows["mb16_g8"], rows["mb16_g8_chunked"]
    assert (f"peaked at {own['peak_rss_gb']:.2f} GB of the enforced {report['ram_budget_gb']:.2f} GB "
            f"({report['ram_budget_gb'] - own['peak_rss_gb']:.2f} GB to spare), with the course's check at "
            f"{chunked['peak_rss_gb']:.2f} GB") in text


def test_notebook_table_t4_times_are_the_reports_estimates():
    """The table's T4 column is each notebook's T4 estimate in reports/gpu_check.json, in the minutes its intro names
    (scripts/course_shape.t4_minutes), and each card that measured the GPU column is named beside it."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import course_shape

    rows = [line for line in README.splitlines() if re.match(r"\| \d\d \| \[", line)]
    for row in rows:
        cells = row.split(" | ")
        name = re.search(r"\(notebooks/(\d\d_[^)]+\.ipynb)\)", cells[1]).group(1)
        entry = REPORT["notebooks"][name]
        low, high = course_shape.t4_minutes(entry["t4_estimate"])
        assert cells[-2].startswith(f"{low}-{high} min"), (name, cells[-2])
        card = entry.get("gpu", REPORT["gpu"]).replace("NVIDIA ", "").split()[0]
        assert f"on an {card}" in cells[-1], (name, cells[-1])


def test_readme_what_is_where_names_every_module_program_script_and_benchmark():
    """Issue 43: the README's "What is where" cannot drift: each helpers module, launched program, script and
    benchmark is named (in backticks) in its folder's row, and every top-level folder has a row."""
    section = README[README.index("## What is where"):]
    section = section[:section.index("\n## ", 3)]
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", section, flags=re.M))
    named = {folder: set(re.findall(r"`([\w./-]+)`", text)) for folder, text in rows.items()}
    expected = {"helpers/": {p.stem for p in (ROOT / "helpers").glob("*.py")} - {"__init__"},
                "notebooks/programs/": {p.name for p in (ROOT / "notebooks" / "programs").glob("*.py")},
                "scripts/": {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()},
                "benchmarks/": {p.name for p in (ROOT / "benchmarks").glob("*.py")}}
    missing = {folder: sorted(names - named.get(folder, set())) for folder, names in expected.items()}
    assert not any(missing.values()), f"README's What is where does not name: {missing}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = {f.split("/")[0] + "/" for f in tracked if "/" in f and not f.startswith(".")}
    assert folders <= set(rows), f"README's What is where has no row for {sorted(folders - set(rows))}"
