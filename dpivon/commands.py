"""How a dpivon command behaves, whatever it does: bad input is one line and exit 2, an
unexpected error one line naming the operation and exit 1, SIGINT/SIGTERM a clean stop,
config keys as typed flags, a progress bar on a terminal, outputs checked before a run."""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from typer._click import exceptions as click_errors  # typer 0.29 vendors its click

from dpivon.config import (
    TrainConfig,
    field_info,
    format_validation_error,
    parse_assignments,
)
from dpivon.errors import DpivonError, first_line
from dpivon.orchestration.interrupts import STOP_SIGNALS, Interrupted, signals_interrupt
from dpivon.paths import check_writable, named_data_path


class OneLineUsageErrors(typer.core.TyperGroup):
    """Usage errors (a flag's bad value, an unknown option) as one line and exit 2, like
    every other input error, instead of click's usage panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError:
            sys.exit(2)  # the help is on the screen already
        except click_errors.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "dpivon"
            message = " ".join(err.format_message().split())
            console.print(
                f"[bold red]error:[/] {message} (see {where} --help)",
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(2)
        except click_errors.ClickException as err:
            console.print(f"[bold red]error:[/] {err.format_message()}", highlight=False)
            sys.exit(err.exit_code)
        except typer.Abort:  # end of input at a prompt, or Ctrl-C
            sys.exit(130)
        except Exception as err:  # outside any command's handler (parsing, the root callback)
            report_unexpected(err, "dpivon", "")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


console = Console(stderr=True)


# The arguments that name what a command works on, for the line of an unexpected error
_SUBJECTS = ("pipeline", "sweep_ref", "config", "optimizer", "model_uri")


def _subject(kwargs: dict[str, Any]) -> str:
    return next((str(kwargs[n]) for n in _SUBJECTS if kwargs.get(n) is not None), "")


def report_unexpected(err: BaseException, operation: str, subject: str) -> None:
    """One red line for an exception nothing anticipated: the operation, its object, the
    exception's type and its first line (the traceback is noise to a user)."""
    what = type(err).__name__
    if str(err).strip():
        what = f"{what}: {first_line(err, 500)}"
    on = f" {subject}" if subject else ""
    console.print(
        f"[bold red]error:[/] {operation}{on} failed: {what}", highlight=False, soft_wrap=True
    )


def user_errors(command: Callable) -> Callable:
    """Bad input (a DpivonError or the library's other ValueErrors) becomes one red line
    and exit code 2; any other exception one red line naming the command and what it was
    working on, and exit code 1; never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, click_errors.ClickException):
            raise  # the command's own exit, or a usage error that the group reports
        except ValueError as err:
            text = format_validation_error(err) if isinstance(err, ValidationError) else str(err)
            message = " ".join(text.split())  # one line, whatever the message holds
            if not isinstance(err, DpivonError):  # a library's: say what it was about
                subject = _subject(kwargs)
                message = f"dpivon {command.__name__}{f' {subject}' if subject else ''}: {message}"
            console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except Exception as err:
            report_unexpected(err, f"dpivon {command.__name__}", _subject(kwargs))
            raise typer.Exit(1) from None

    return wrapper


def stops_on_signals(command: Callable) -> Callable:
    """SIGTERM stops the command as Ctrl-C does: a run in progress ends KILLED (never left
    RUNNING, `Tracker.run`), one line, and the shell's exit code (130 SIGINT, 143 SIGTERM)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with signals_interrupt():
                return command(*args, **kwargs)
        except Interrupted as stop:
            console.print(f"dpivon {command.__name__} {stop}: a run in progress ended KILLED",
                          highlight=False)  # fmt: skip
            raise typer.Exit(stop.exit_code) from None

    return wrapper


def end_ray() -> int | None:
    """Shut down the Ray a command started or joined now, not in the interpreter's exit
    handler, where a Ctrl-C prints Ray's 50-line traceback. Meanwhile a first SIGINT or
    SIGTERM is one line and waits for the shutdown; a second ends the process at once.
    Returns the exit code a stop asks for (None: none came)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    received: list[int] = []

    def wait_or_end(number: int, frame: Any) -> None:
        if received:
            os._exit(128 + number)
        received.append(number)
        console.print(f"{signal.Signals(number).name}: waiting for Ray to shut down (again to "
                      "end at once)", highlight=False)  # fmt: skip

    previous = {number: signal.signal(number, wait_or_end) for number in STOP_SIGNALS}
    try:
        ray.shutdown()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 128 + received[0] if received else None


def _flag_type(annotation: Any) -> tuple[type, str]:
    """The Python type a flag parses to, and the choices of a Literal field."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return str, ", ".join(map(str, typing.get_args(annotation)))
    return annotation, ""


def config_flags(*keys: str, required: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Give a command one ``--flag`` per flat config key, typed and described by the config
    tree, plus ``--set PATH=VALUE`` for every other option. The command receives the given
    ones as ``config_values`` (flat keys; None = not given). The ``required`` flags are
    marked so in ``--help``, and their absence is a usage error."""

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != "config_values"]
        flags = []
        for key in keys:
            path, info = field_info(key)
            flag_type, choices = _flag_type(info.annotation)
            default = "per optimizer" if info.is_required() else info.default
            needed = key in required
            help_text = f"{path}" + (f": {choices}" if choices else "")
            if not needed:
                help_text += f" [default: {default}]"
            option = typer.Option(help=help_text, show_default=False)
            flags.append(
                inspect.Parameter(
                    key,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=inspect.Parameter.empty if needed else None,
                    annotation=Annotated[flag_type if needed else flag_type | None, option],
                )
            )
        assignments = inspect.Parameter(
            "set_values",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                list[str] | None,
                typer.Option(
                    "--set",
                    metavar="PATH=VALUE",
                    help="any config option by its path, e.g. --set optimizer.hess_floor=1e-3 "
                    "(repeatable; values are YAML)",
                ),
            ],
        )

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {key: kwargs.pop(key) for key in keys}
            values = {k: v for k, v in given.items() if v is not None}
            extra = parse_assignments(kwargs.pop("set_values") or [])
            twice = sorted(set(values) & set(extra))
            if twice:
                raise DpivonError(f"{twice[0]} given both as --{twice[0].replace('_', '-')} "
                                  "and with --set; give it once")  # fmt: skip
            return command(*args, config_values={**values, **extra}, **kwargs)

        hints = typing.get_type_hints(command, include_extras=True)
        parameters = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]) for p in own
        ]
        parameters += [*flags, assignments]
        wrapper.__signature__ = signature.replace(parameters=parameters)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return decorate


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable]:
    """A steps-of-training bar on stderr (stdout stays for results): yields the callback
    that training and audits report their steps to (dpivon.runs.StepReport)."""
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )
    tasks: dict[str, Any] = {}

    def on_step(report) -> None:
        if report.task not in tasks:
            tasks[report.task] = bar.add_task(report.task, total=report.total, status="")
        bar.update(tasks[report.task], completed=report.done, status=report.status)

    with bar:
        yield on_step


Opt = Annotated


def warn_of_research_mode(research: bool) -> None:
    """Once, on the console of a command that trains in research mode: nothing it releases
    has a DP guarantee (its runs say so too: the dpivon.noise tag)."""
    if research:
        from dpivon.privacy.noise import RESEARCH_MODE_WARNING  # loads torch

        console.print(f"[bold yellow]warning:[/] {RESEARCH_MODE_WARNING}", highlight=False)


def warn_of_frozen_curvature(configs: Iterable[TrainConfig]) -> None:
    """One line per distinct IVON-family setting whose curvature cannot learn by its last
    step (`dpivon.runs.frozen_curvature_warning`), before its runs start; they still run."""
    from dpivon.runs.setup import frozen_curvature_warning

    lines = dict.fromkeys(line for c in configs if (line := frozen_curvature_warning(c)))
    for line in lines:
        console.print(f"[bold yellow]warning:[/] {line}", highlight=False)


def check_outputs(json_path: Path | None, experiment: str, tracking_uri: str | None) -> None:
    """Outputs that would fail only after a long run fail now: an unwritable --json path,
    an empty experiment name, a SQLite store that cannot be written."""
    if not experiment.strip():
        raise DpivonError("--experiment must not be empty")
    if json_path is not None:
        check_writable(json_path, "--json")
    from dpivon.tracking.client import check_sqlite_store, resolve_tracking_uri  # loads MLflow

    check_sqlite_store(resolve_tracking_uri(tracking_uri))


def check_data_source(config: TrainConfig) -> None:
    """A CIFAR-10 path (``data.data_path`` or $DPIVON_DATA) that does not exist, refused
    before the command imports torch to load it."""
    if config.data.dataset == "cifar10":
        named_data_path(config.data.data_path)
