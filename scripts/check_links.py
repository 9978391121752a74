#!/usr/bin/env python3
"""Checks the relative links of README.md, CONTRIBUTING.md, CHANGELOG.md and the guide (docs/).

Every relative link must name a file or directory that exists, and its `#anchor`, if any, a
heading (or an `<a id>`) of the Markdown file it points at. A page of the guide must not link
out of docs/: mdBook builds the book from docs/ alone, so such a link works on the repository
host but not in the built book (name the file as code, `crates/...`, instead). Every page in
docs/ must be listed in docs/SUMMARY.md, or the book leaves it out.

Usage: scripts/check_links.py [FILE.md ...]   (default: the files above)
Exits 1 listing each broken link as FILE:LINE: problem, 0 when there is none. Stdlib only.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

FENCE = re.compile(r"^\s*(```+|~~~+)")
# [text](target) and ![alt](target); the target may be <...> and may carry a "title".
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HTML_ID = re.compile(r"""<a\s[^>]*?(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def lines_outside_code(text):
    """Yields (line number, line) for the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        yield number, line


def slug(heading):
    """The anchor GitHub and mdBook give a heading: its text lower-cased, spaces to hyphens,
    everything but letters, digits, `-` and `_` dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


_anchors = {}


def anchors(path):
    """Every anchor a Markdown file has: its headings' slugs (a repeated one gets -1, -2, ...)
    and the ids of its `<a id>` tags."""
    if path not in _anchors:
        found, seen = set(), {}
        for _, line in lines_outside_code(path.read_text(encoding="utf-8")):
            found.update(HTML_ID.findall(line))
            match = HEADING.match(line)
            if match:
                base = slug(match.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
        _anchors[path] = found
    return _anchors[path]


def links(text):
    """Yields (line number, target) for every link outside code."""
    for number, line in lines_outside_code(text):
        bare = CODE_SPAN.sub("", line)
        for match in INLINE.finditer(bare):
            yield number, match.group(1).strip("<>")
        match = REFERENCE.match(bare)
        if match:
            yield number, match.group(1).strip("<>")
        for target in HTML_LINK.findall(bare):
            yield number, target


def check(path):
    problems = []
    in_book = DOCS in path.parents
    for number, target in links(path.read_text(encoding="utf-8")):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # absolute URLs are not checked here
        where = f"{path.relative_to(ROOT)}:{number}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if file_part and not resolved.exists():
            problems.append(f"{where}: {target}: no such file")
            continue
        if in_book and file_part and DOCS != resolved and DOCS not in resolved.parents:
            problems.append(f"{where}: {target}: leaves docs/, so the built book cannot follow it")
            continue
        if anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{where}: {target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(resolved):
                problems.append(f"{where}: {target}: {resolved.name} has no heading #{anchor}")
    return problems


def unlisted_pages():
    """Pages in docs/ that SUMMARY.md does not list (mdBook would leave them out)."""
    summary = DOCS / "SUMMARY.md"
    listed = {
        (DOCS / target.partition("#")[0]).resolve()
        for _, target in links(summary.read_text(encoding="utf-8"))
        if target and not SCHEME.match(target)
    }
    return [
        f"{page.relative_to(ROOT)}: not listed in docs/SUMMARY.md"
        for page in sorted(DOCS.rglob("*.md"))
        if page != summary and page.resolve() not in listed
    ]


def main(argv):
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
        files += sorted(DOCS.rglob("*.md"))
    problems = []
    for path in files:
        problems += check(path)
    if not argv:
        problems += unlisted_pages()
    for problem in problems:
        print(problem)
    checked = len(files)
    if problems:
        print(f"{len(problems)} broken link(s) in {checked} file(s)", file=sys.stderr)
        return 1
    print(f"links: {checked} files, every relative link resolves", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
