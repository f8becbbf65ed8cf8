"""The lm-evaluation-harness bridge's library half (``scripts/eval_harness.py`` is the command):
which tasks a ``--tasks`` list names, loading them, and one ``simple_evaluate`` of an exported
Hugging Face folder with lm-eval's own ``hf`` model.

lm-eval is an optional dependency (``pip install 'lm-eval[hf]'``): it is imported here, inside
the functions, and its absence is a UserError carrying the install command. Everything a user
can get wrong (a task name, a task file, a folder of them) is a UserError naming it, raised
before the checkpoint is exported.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from titanlite.errors import UserError

logger = logging.getLogger(__name__)

# The release the bridge is tested with: earlier ones lack TaskManager.load and YAML paths as
# task names.
MINIMUM = "0.4.13"
INSTALL = f"pip install 'lm-eval[hf]>={MINIMUM}'"
YAML_SUFFIXES = (".yaml", ".yml")


def import_lm_eval() -> ModuleType:
    """lm_eval, with what its ``hf`` model needs (transformers, accelerate) importable."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401 (the "hf" model: accelerate, transformers)
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        missing = e.name or "lm_eval"
        what = (
            "lm-eval is not installed"
            if missing.split(".")[0] == "lm_eval"
            else (f"lm-eval's Hugging Face model needs {missing}, which is not installed")
        )
        raise UserError(f"{what}: {INSTALL} (or pip install -e '.[harness]')") from None
    from packaging.version import Version  # transformers' dependency

    if Version(lm_eval.__version__) < Version(MINIMUM):
        raise UserError(
            f"lm-eval {lm_eval.__version__} is older than the bridge needs ({MINIMUM}): {INSTALL}"
        )
    return lm_eval


@dataclass
class TaskSelection:
    """What ``--tasks`` and ``--include-path`` resolve to: lm-eval task specs (registered
    names, or paths of YAML files) and the folders lm-eval indexes for names."""

    specs: list[str] = field(default_factory=list)
    include_paths: list[Path] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the specs that are names, not files


def select_tasks(items: list[str], include_paths: list[Path]) -> TaskSelection:
    """Sort ``items`` into YAML files, folders of them (indexed as include paths; each stands
    for every task its YAML files define) and names (or glob patterns) of tasks. Files and
    folders are checked here: missing, or YAML that does not parse, is a UserError."""
    selection = TaskSelection(include_paths=[])
    for folder in include_paths:
        if not folder.is_dir():
            raise UserError(f"--include-path {str(folder)!r} is not a folder")
        check_yaml_folder(folder)
        selection.include_paths.append(folder.resolve())
    for item in items:
        path = Path(item).expanduser()
        names = []
        if path.is_dir():
            check_yaml_folder(path)
            names = folder_tasks(path)
            if not names:
                raise UserError(
                    f"--tasks: folder {item!r} defines no task "
                    "(no YAML file in it has a task: name)"
                )
            selection.include_paths.append(path.resolve())
        elif path.suffix in YAML_SUFFIXES or path.is_file():
            if not path.is_file():
                raise UserError(f"--tasks: task file {item!r} does not exist")
            config = read_yaml(path)
            if not isinstance(config.get("task", config.get("group")), str):
                raise UserError(
                    f"--tasks: {item!r} defines no task (a task YAML has a task: or group: name)"
                )
            selection.specs.append(str(path.resolve()))
        else:
            names = [item]
        names = [n for n in names if n not in selection.names]
        selection.names += names
        selection.specs += names
    return selection


def read_yaml(path: Path) -> dict[str, Any]:
    """A task YAML as a mapping (lm-eval's ``!function`` tags and other tags read as
    nothing); UserError naming the file and line of a syntax error."""
    import yaml  # lm-eval's dependency

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"task file {str(path)!r} is not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise UserError(f"task file {str(path)!r} is unreadable ({reason})") from None
    if not isinstance(config, dict):
        raise UserError(f"task file {str(path)!r} is not a YAML mapping of task settings")
    return config


def yaml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in YAML_SUFFIXES and p.is_file())


def check_yaml_folder(folder: Path) -> None:
    """Every YAML file under ``folder`` parses (lm-eval's index skips one that does not,
    silently, and its tasks would then be "unknown")."""
    for path in yaml_files(folder):
        read_yaml(path)


def folder_tasks(folder: Path) -> list[str]:
    """The names of the tasks the YAML files under ``folder`` define (files that only hold
    settings other files include have none)."""
    names = []
    for path in yaml_files(folder):
        config = read_yaml(path)
        if isinstance(config.get("task"), str) and "group" not in config:
            names.append(config["task"])
    return names


def task_manager(selection: TaskSelection) -> Any:
    """lm-eval's TaskManager for ``selection``: the include paths alone when they define
    every name (quick), else lm-eval's own tasks as well (indexing them takes a while)."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(
        include_path=[str(p) for p in selection.include_paths], include_defaults=False
    )
    if not unknown_names(local, selection.names):
        return local
    logger.info("indexing lm-eval's tasks (for %s)", ", ".join(selection.names))
    manager = TaskManager(include_path=[str(p) for p in selection.include_paths] or None)
    unknown = unknown_names(manager, selection.names)
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        hint = (
            f"; did you mean {' or '.join(map(repr, close))}?"
            if close
            else ("; `lm-eval ls tasks` lists them, a local task is a YAML file or folder path")
        )
        raise UserError(f"--tasks: unknown task {name!r}{hint}")
    return manager


def unknown_names(manager: Any, names: list[str]) -> list[str]:
    known = manager.all_tasks
    return [n for n in names if not fnmatch.filter(known, n)]


def load_tasks(manager: Any, selection: TaskSelection) -> list[Any]:
    """The tasks and groups ``selection`` names, built (their datasets loaded): the top-level
    objects, each group with its own tasks. UserError naming the spec whose loading failed."""
    expanded = []
    for spec in selection.specs:
        is_pattern = spec in selection.names and any(c in spec for c in "*?[")
        expanded += manager.match_tasks([spec]) if is_pattern else [spec]
    top = []
    for spec in dict.fromkeys(expanded):
        try:
            loaded = manager.load([spec])
        except Exception as e:  # any failure to build a task the user named is their input's
            raise UserError(f"--tasks: {spec}: {first_line(e)}") from None
        children = {name for names in loaded["group_map"].values() for name in names}
        top += [g for name, g in loaded["groups"].items() if name not in children]
        top += [t for name, t in loaded["tasks"].items() if name not in children]
    try:
        manager.load(top)  # refuses a task named both alone and in a group, or in two groups
    except ValueError as e:
        raise UserError(f"--tasks: {first_line(e)}") from None
    return top


def first_line(error: BaseException) -> str:
    """An error's message, its first line, without the quotes a KeyError adds or the class
    name some libraries end it with ("Couldn't reach ... (OfflineModeIsEnabled)")."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else error
    lines = str(text).strip().splitlines()
    return (
        re.sub(r" \([A-Z][a-z]+(?:[A-Z][a-z]+)+\)$", "", lines[0])
        if lines
        else "it could not be loaded"
    )


def evaluate(
    folder: Path,
    tasks: list[Any],
    manager: Any,
    *,
    device: str,
    dtype: str,
    batch_size: int | str,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of the Hugging Face folder ``folder`` (its "hf" model)
    on ``tasks``. Every sequence starts with BOS, as titanlite trains and scores."""
    import lm_eval

    model_args = {"pretrained": str(folder), "dtype": dtype, "add_bos_token": True}
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        device=device,
        batch_size=batch_size,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
    )
    if results is None:  # lm-eval returns results on its rank 0 only; this is one process
        raise RuntimeError("lm-eval returned no results")
    return dict(results)


def results_tables(results: dict[str, Any]) -> str:
    """lm-eval's own tables of the results (and of group aggregates when there are groups)."""
    from lm_eval.utils import make_table

    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


def json_value(value: Any) -> Any:
    """For json.dumps: numpy values as numbers and lists, sets as lists, anything else as its
    text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
