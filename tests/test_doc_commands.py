"""Every shell command in README.md and docs/*.md is checked or skipped by a named rule: an mpp command line
(`python launch.py ...`, `accelerate launch ... launch.py ...`, `mpp ...`, `-m mpp.pipelines ...`) is parsed with
the real command line's parser and the config and overrides it names are loaded (no training, no data read); any
other command is skipped by one of SKIPPED's rules, and a line that is neither fails, naming the doc and line."""

import re
import shlex

from mpp.config import load_config
from pipelines import cli
from pipelines.commands import COMMANDS, config_file
from pipelines.comparison.plan import load_compare_config

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell"}  # fences whose lines are commands; every fence says what it holds (text, python, ...)
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}

# A command that is not mpp's, by how it begins, and why the check leaves it alone.
SKIPPED = [
    (r"(sudo )?(pip|apt-get|apt) ", "installs packages"),
    (r"accelerate config", "writes Accelerate's own config"),
    (r"tensorboard ", "TensorBoard's viewer"),
    (r"python -m pytest", "the test suite itself"),
    (r"python -m pipelines\.reference$", "rewrites docs/reference.md (tests/test_config_model.py fails while it is stale)"),
    (r"python3? -c ", "inline Python shown with its output"),
    (r"python benchmarks/", "a benchmark script (benchmarks/, with its own options)"),
    (r"(git|farm-bench) ", "another tool's command"),
    (r"(export|if|then|fi|for|do|done|wait|trap|exit|kill|cd|head)( |$)|\w+=\S*$", "the shell's own"),
    (r"(scontrol|scancel|srun) ", "SLURM's commands (an mpp command inside srun's quotes is checked on its own)"),
]
# Docs whose commands need parts that a test registers first, and the test that checks them.
CHECKED_ELSEWHERE = {"docs/extending.md": "tests/test_extending.py::test_the_guides_commands_parse_with_its_parts_registered"}
PLACEHOLDERS = {"..."}  # a word that stands for the rest of the line as the reader likes it: dropped


def fences(text: str):
    """(language, first line number, body) of each fenced block."""
    for match in re.finditer(r"^```(\S*)\n(.*?)^```", text, re.S | re.M):
        yield match.group(1), text[: match.start()].count("\n") + 2, match.group(2)


def logical_lines(body: str, first: int):
    """(line number, line) with backslash continuations and quotes over several lines (`python -c "..."`) joined."""
    number, pending = first, ""
    for offset, line in enumerate(body.splitlines()):
        if not pending:
            number = first + offset
        pending += line
        if line.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open
            pending += "\n"
            continue
        if pending.strip():
            yield number, pending.strip()
        pending = ""
    if pending:
        yield number, pending


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command of a shell line, split at its operators (comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands = [[]]
    for word in lexer:
        if word in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def without_environment(words: list[str]) -> list[str]:
    """The command after its environment assignments (`OMP_WAIT_POLICY=PASSIVE python ...`) and an `exec`."""
    while len(words) > 1 and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "exec"):
        words = words[1:]
    return words


def mpp_arguments(words: list[str]) -> list[str] | None:
    """The arguments of mpp's command line if `words` runs it, else None."""
    words = without_environment(words)
    if words[:1] == ["mpp"]:
        return words[1:]
    if words[:1] in (["python"], ["torchrun"]) or words[:2] == ["accelerate", "launch"]:
        if "launch.py" in words:
            return words[words.index("launch.py") + 1:]
        for module in ("mpp.pipelines", "pipelines"):
            if ["-m", module] in [words[i:i + 2] for i in range(len(words) - 1)]:
                return words[words.index(module) + 1:]
    return None


def check_mpp_command(argv: list[str]) -> None:
    """Parses `argv` as mpp's command line does and loads the config and overrides it names."""
    args = cli.parse_args([word for word in argv if word not in PLACEHOLDERS])
    command = COMMANDS[args.stage]
    if command.config == "training":
        load_config(config_file(args.stage, args.config or "default"), args.overrides)
    elif command.config == "checkpoint":  # the run that wrote --ckpt is not at hand: its config is the defaults
        load_config(args.config, args.overrides)
    elif args.stage == "compare":
        load_compare_config(config_file("compare", args.config), args.overrides)


def problems(name: str, text: str, tally: dict) -> list[str]:
    """What is wrong with the shell commands of one doc, each as "doc:line: command: why"; counts what was checked
    and skipped in `tally`."""
    found = []
    for language, first, body in fences(text):
        if not language:
            found.append(f"{name}:{first - 1}: a fence without a language (bash for commands, text for output)")
        if language not in SHELL:
            continue
        for number, line in logical_lines(body, first):
            try:
                commands = simple_commands(line)
            except ValueError as err:
                found.append(f"{name}:{number}: {line}: not a shell line ({err})")
                continue
            for words in commands:
                found += [f"{name}:{number}: {' '.join(words)}: {why}" for why in check_words(words, tally)]
    return found


def check_words(words: list[str], tally: dict) -> list[str]:
    """Why one command is wrong ([] if it is fine): checked if it runs mpp (and any mpp command quoted inside it,
    as `srun bash -c '...'` runs), else skipped by a rule."""
    inner = [word for word in words if " " in word and mpp_arguments(word.split())]
    wrong = [why for word in inner for part in simple_commands(word) for why in check_words(part, tally)]
    argv = mpp_arguments(words)
    if argv is not None:
        try:
            check_mpp_command(argv)
            tally["checked"] += 1
        except SystemExit as stop:  # argparse refused the line
            wrong.append(f"the command line is refused (exit {stop.code})")
        except Exception as err:
            wrong.append(f"{type(err).__name__}: {err}")
        return wrong
    rule = next((why for pattern, why in SKIPPED if re.match(pattern, " ".join(without_environment(words)))), None)
    if rule is None:
        return [*wrong, "neither an mpp command nor skipped by a rule of SKIPPED"]
    tally[rule] = tally.get(rule, 0) + 1
    return wrong


def test_every_shell_command_in_the_readme_and_guides_parses_and_loads(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the docs' commands run from a checkout's root (configs/...)
    tally = {"checked": 0}
    docs = [doc for doc in DOCS if str(doc.relative_to(ROOT)) not in CHECKED_ELSEWHERE]
    found = [problem for doc in docs for problem in problems(str(doc.relative_to(ROOT)), doc.read_text(), tally)]
    capsys.readouterr()  # argparse's own usage lines for a refused command
    assert found == []
    assert tally["checked"] >= 50, tally  # the check runs: README and the guides hold dozens of mpp commands


def test_a_wrong_command_is_named_by_doc_and_line(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    doc = ("# Guide\n\n```bash\npython launch.py pretrain train.steps=3      # fine\n"
           "python launch.py pretrain train.stpes=3\n"
           "accelerate launch --multi_gpu launch.py pretrian\n"
           "pip install mpp && frobnicate --all\n"
           "srun bash -c 'exec python launch.py knn --ckpt RUN knn.k=zero'\n"
           "```\n\n```\nunlabelled\n```\n")
    tally = {"checked": 0}
    found = problems("guide.md", doc, tally)
    capsys.readouterr()
    assert [problem.split(": ", 1)[0] for problem in found] == ["guide.md:5", "guide.md:6", "guide.md:7", "guide.md:8", "guide.md:11"]
    assert "unknown config key 'train.stpes'" in found[0] and "refused (exit 2)" in found[1]
    assert "frobnicate --all: neither an mpp command" in found[2] and "knn.k" in found[3]
    assert tally == {"checked": 1, "installs packages": 1, SKIPPED[-1][1]: 1}


def test_every_test_the_docs_name_exists():
    """The guides cite tests as evidence (`test_x.py::test_name`): a renamed or removed test must take its citation
    along, or the docs promise a check nobody runs."""
    cited = {(doc.name, file, name) for doc in DOCS
             for file, name in re.findall(r"(test_\w+\.py)::(test_\w+)", doc.read_text())}
    defined = {path.name: set(re.findall(r"^def (test_\w+)", path.read_text(), re.M)) for path in (ROOT / "tests").glob("test_*.py")}
    missing = sorted((doc, f"{file}::{name}") for doc, file, name in cited if name not in defined.get(file, set()))
    assert cited and not missing, missing
