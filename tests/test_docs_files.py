"""The files the documentation's commands read are in the repository (static, fast)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "results/README.md", "results/HISTORY.md")
# a repository path as a command names it (not a part of /opt/dpivon/... in a container)
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:pipelines|search_spaces|results|benchmarks|docker)/[\w./-]+"
    r"\.(?:ya?ml|py|sh|json))"
)


def command_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.DOTALL)


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_a_documented_command_reads_exists(doc: str) -> None:
    blocks = command_blocks((REPO / doc).read_text())
    assert blocks, f"{doc} shows no command"
    for block in blocks:
        written = set(re.findall(r"--(?:out|json)\s+(\S+)", block))  # made by the block
        read = [*REPO_PATH.findall(block), *re.findall(r"--config\s+(\S+)", block)]
        missing = sorted({f for f in read if f not in written and not (REPO / f).is_file()})
        assert not missing, f"{doc} runs commands on {missing}, which are not in the repository"
