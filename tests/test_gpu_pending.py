"""scripts/gpu_pending.sh and gpu_evidence.sh: every benchmark command a GPU call will run parses with that
benchmark's own options. A flag a benchmark does not have costs a whole device call (minutes of a 30-minute budget)
and is found only there; here it fails in a second."""
import argparse
import re
import shlex

import pytest

from conftest import ROOT, load_script

SCRIPTS = [ROOT / "scripts" / "gpu_pending.sh", ROOT / "scripts" / "gpu_evidence.sh"]


def _commands() -> list[tuple[str, str, list[str]]]:
    """(script, benchmark, its arguments) for every `python3 benchmarks/NAME.py ...` in the GPU scripts, the shell's
    line continuations joined, redirections dropped, shell variables replaced by a stand-in word."""
    found = []
    for script in SCRIPTS:
        text = re.sub(r"\\\n\s*", " ", script.read_text())
        for line in text.splitlines():
            m = re.search(r"python3 benchmarks/(\w+)\.py([^'\n]*)", line)
            if not m or line.lstrip().startswith("#"):
                continue
            args = re.sub(r"\d?>>?\s*\"?[^\s\"]*\"?|\d?>&\d|<\s*\S+", " ", m.group(2))  # redirections
            args = re.split(r"\s[&;|]", args + " ")[0]  # the command ends at the shell's next operator
            args = re.sub(r"\$\{\w*ARGS[^}]*\}", "", args)  # extra arguments a caller may pass (none here)
            args = re.sub(r"\$\{[^}]*\}|\$\(\([^)]*\)\)|\$\w+", "X", args)  # shell variables
            found.append((script.name, m.group(1), shlex.split(args.replace('"', ""))))
    return found


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("script,bench,args", _commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_benchmark_command_of_the_gpu_scripts_parses(script, bench, args, monkeypatch):
    module = load_script(ROOT / "benchmarks" / f"{bench}.py", f"gpu_cmd_{bench}")
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(original(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        module.main(args)
    except _Parsed:
        return
    except SystemExit as exc:
        pytest.fail(f"{script}: benchmarks/{bench}.py {' '.join(args)}: argparse refused it (exit {exc.code})")
    pytest.fail(f"{script}: benchmarks/{bench}.py never parsed its arguments")


def test_the_scripts_hold_the_benchmark_commands_the_steps_name():
    benches = {b for _, b, _ in _commands()}
    assert {"ladder", "offload_speed", "long_context", "cuda_context", "zero0_fp16_step", "host_memory"} <= benches
