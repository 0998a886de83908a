"""Plain text from a MediaWiki XML dump (the gensim test enwiki dump that serves as the demo's
second-domain perplexity set, docs/design.md §4).

`iter_articles(path)` streams (title, wikitext) of main-namespace, non-redirect pages from a .xml or
.xml.bz2 file; `clean(wikitext)` removes markup "reasonably": comments, <ref>s, templates, tables,
files/categories, link syntax (keeping the shown text), bold/italic quotes, HTML tags and entities,
list markers, and everything from the first See also / References / External links heading on.
"""

from __future__ import annotations

import bz2
import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_LINK = re.compile(r"\[\[([^\[\]|]*)(?:\|([^\[\]]*))?\]\]")
_EXT_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]+(?: ([^\]]*))?\]")
_QUOTES = re.compile(r"'{2,5}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_TAG = re.compile(r"<[^<>]+>")
_BLOCK_TAGS = re.compile(r"<(gallery|math|timeline|score|syntaxhighlight|source|pre)[^>]*>.*?</\1>", re.S | re.I)
_TAIL = re.compile(
    r"^==+\s*(See also|References|External links|Further reading|Notes|Sources|Bibliography)\s*==+", re.M | re.I
)
_DROP_PREFIXES = ("File:", "Image:", "Category:", "Media:")
MIN_CHARS = 200  # cleaned articles shorter than this (stubs, lists) are left out


def _repeat(pattern: re.Pattern, repl, text: str) -> str:
    """Applies a substitution until nothing changes (for nested constructs, innermost first)."""
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return new
        text = new


_BRACES = re.compile(r"\{\{|\}\}")
_BRACKETS = re.compile(r"\[\[|\]\]")
_FILE_START = re.compile(r"\[\[\s*:?\s*(?:File|Image|Category|Media):", re.I)


def _span_end(text: str, start: int, marks: re.Pattern, opener: str) -> int:
    """End of the nested construct opening at start (by depth over opener/closer marks); -1 if unclosed."""
    depth = 0
    for m in marks.finditer(text, start):
        depth += 1 if m.group() == opener else -1
        if depth == 0:
            return m.end()
    return -1


def _drop_nested(text: str, starts: re.Pattern, marks: re.Pattern, opener: str) -> str:
    """Removes every construct matched by `starts` through its balanced end (templates and file links may
    hold stray brackets a flat regex trips on); an unclosed one is cut to the end of its line."""
    out, pos = [], 0
    while True:
        m = starts.search(text, pos)
        if not m:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos : m.start()])
        end = _span_end(text, m.start(), marks, opener)
        if end < 0:
            nl = text.find("\n", m.start())
            end = len(text) if nl < 0 else nl
        pos = end


def _drop_templates(text: str) -> str:
    return _drop_nested(text, re.compile(r"\{\{"), _BRACES, "{{")


def _link(m: re.Match) -> str:
    target, shown = m.group(1), m.group(2)
    t = target.strip().lstrip(":")
    if t.startswith(_DROP_PREFIXES) or re.match(r"^[a-z]{2,3}(-[a-z]+)?:", t):  # files, categories, interwiki
        return ""
    return shown if shown is not None else target


def clean(text: str) -> str:
    """Readable plain text from one article's wikitext."""
    m = _TAIL.search(text)
    if m:
        text = text[: m.start()]
    text = _COMMENT.sub("", text)
    text = _BLOCK_TAGS.sub("", text)
    text = _REF.sub("", text)
    text = _drop_templates(text)
    text = _drop_nested(text, _FILE_START, _BRACKETS, "[[")
    text = _repeat(_TABLE, "", text)
    text = _repeat(_LINK, _link, text)
    text = _EXT_LINK.sub(lambda m: m.group(1) or "", text)
    text = _QUOTES.sub("", text)
    text = _HEADING.sub(lambda m: m.group(2), text)
    text = _TAG.sub("", text)
    text = html.unescape(text)
    lines = []
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith(("{|", "|", "!", "}}", "{{", "__")):
            continue
        s = re.sub(r"^[*#:;]+\s*", "", s)
        s = re.sub(r"\(\s*[,;]?\s*\)", "", s)  # "( )" left behind by removed templates
        s = re.sub(r"[ \t]{2,}", " ", s)
        lines.append(s)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def iter_articles(path: str | Path):
    """Yields (title, wikitext) for main-namespace, non-redirect pages, streaming (bounded memory)."""
    path = Path(path)
    fh = bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")
    with fh:
        title = ns = None
        redirect = False
        for _event, el in ET.iterparse(fh, events=("end",)):
            tag = el.tag.rsplit("}", 1)[-1]
            if tag == "title":
                title = el.text
            elif tag == "ns":
                ns = el.text
            elif tag == "redirect":
                redirect = True
            elif tag == "text":
                if ns == "0" and not redirect and el.text:
                    yield title, el.text
            elif tag == "page":
                title, ns, redirect = None, None, False
                el.clear()


def articles(path: str | Path):
    """Yields {"title", "text"} for every article whose cleaned text has at least MIN_CHARS characters."""
    for title, wikitext in iter_articles(path):
        body = clean(wikitext)
        if len(body) >= MIN_CHARS:
            yield {"title": title, "text": f"{title}\n\n{body}"}
