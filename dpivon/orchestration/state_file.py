"""The state file of a sweep or benchmark: what a resumed driver reads back.

One JSON object in the run's folder (``sweep.json``, ``benchmark.json``), written and read
through :class:`~dpivon.orchestration.storage.ResultsStorage`, so wherever the folder is
stored (a local disk, ``s3://``, ``gs://``). It names the parent MLflow run, never a
password (a resume is given the tracking URI again).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar, Self

from dpivon.errors import DpivonError
from dpivon.orchestration.storage import ResultsStorage


@dataclass
class RunState:
    """The state every driver keeps: which file started it and where its runs are tracked.
    A subclass adds its own fields and names its file."""

    file_name: ClassVar[str]
    kind: ClassVar[str]  # what drives it: a sweep, a benchmark

    name: str
    pipeline_path: str
    tracking_uri: str  # redacted: no password
    experiment: str
    parent_run_id: str

    @classmethod
    def exists(cls, storage: ResultsStorage) -> bool:
        return storage.exists(cls.file_name)

    @classmethod
    def load(cls, storage: ResultsStorage) -> Self:
        """The state in ``storage``; keys this version does not know (an older driver's)
        are ignored, missing ones are one line naming the file."""
        state = storage.read_json(cls.file_name)
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in state.items() if k in known})
        except TypeError as err:
            raise DpivonError(
                f"{storage.uri}/{cls.file_name} lacks the {cls.kind}'s state "
                f"({type(err).__name__}: {err}); a damaged {cls.kind} file"
            ) from None

    def save(self, storage: ResultsStorage) -> None:
        storage.write_text(self.file_name, json.dumps(dataclasses.asdict(self), indent=2))
