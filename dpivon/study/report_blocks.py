"""A report as blocks (headings, paragraphs, bullets, tables, figures) rendered to Markdown
and to one self-contained HTML page from the same blocks, so the two never disagree: the
HTML embeds every figure as a base64 PNG, the Markdown links the PNGs written beside it."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FIGURES = "figures"  # the report's folder of PNGs, beside report.md


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class TableBlock:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Images:
    """Figures side by side: file names (under figures/) with their PNG bytes."""

    names: list[str]
    caption: str = ""


Block = Heading | Paragraph | Bullets | TableBlock | Images


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def inline_html(text: str) -> str:
    """Escape, then the two inline marks the report uses: **bold** and `code`."""
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


HTML_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f2f2f2} td:first-child,th:first-child{text-align:left}
.images{display:flex;flex-wrap:wrap;gap:8px} .images img{max-width:100%}
figcaption{font-size:0.9em;color:#555}
code{background:#f4f4f4;padding:0 3px}
"""


def blocks_markdown(title: str, blocks: Sequence[Block]) -> str:
    """The blocks as Markdown, under ``title``; figures link to ``figures/<name>``."""
    parts = [f"# {title}"]
    for block in blocks:
        if isinstance(block, Heading):
            parts.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, TableBlock):
            parts.append(markdown_table(block.header, block.rows))
        else:
            images = " ".join(f"![{n}]({FIGURES}/{n})" for n in block.names)
            parts.append(images + (f"\n\n*{block.caption}*" if block.caption else ""))
    return "\n\n".join(parts) + "\n"


def blocks_html(title: str, blocks: Sequence[Block], figures: Mapping[str, bytes]) -> str:
    """The blocks as one self-contained HTML page: every figure embedded as a base64 PNG."""
    parts = [f"<h1>{html.escape(title)}</h1>"]
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{inline_html(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{inline_html(block.text)}</p>")
        elif isinstance(block, Bullets):
            items = "".join(f"<li>{inline_html(item)}</li>" for item in block.items)
            parts.append(f"<ul>{items}</ul>")
        elif isinstance(block, TableBlock):
            head = "".join(f"<th>{inline_html(h)}</th>" for h in block.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{inline_html(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            images = "".join(
                f'<img alt="{html.escape(n)}" src="data:image/png;base64,'
                f'{base64.b64encode(figures[n]).decode()}">'
                for n in block.names
            )
            caption = f"<figcaption>{inline_html(block.caption)}</figcaption>"
            parts.append(f'<figure><div class="images">{images}</div>{caption}</figure>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{HTML_STYLE}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )
