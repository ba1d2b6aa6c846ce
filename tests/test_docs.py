"""Docs and library text cite only what the repository holds: every repository path named
in library code (gemjax/, kernels/), in the programs (experiments/, benchmarks/, tools/),
in docs/ and in README.md exists, every relative Markdown link of README.md and docs/*.md
points at an existing file (and heading, where it names one), the README links every
docs page, and no library text names a Markdown file the repository lacks (a design note
kept elsewhere)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("gemjax", "kernels", "experiments", "benchmarks", "tools", "tests", "docs")
# a path under one of the top-level folders, e.g. kernels/gdpa/reference.py, tests/test_*.py
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w*.<>/-]*[\w*])" % "|".join(TOP))
MARKDOWN = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
# a Markdown link [text](target); the target up to its closing parenthesis
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _files(folders, exts):
    out = []
    for folder in folders:
        for ext in exts:
            out += glob.glob(os.path.join(ROOT, folder, "**", f"*.{ext}"), recursive=True)
    return sorted(out)


def _exists(path):
    path = path.rstrip(".")
    if "<" in path:                               # a pattern such as docs/<area>.md
        return True
    if "*" in path:
        return bool(glob.glob(os.path.join(ROOT, path)))
    return os.path.exists(os.path.join(ROOT, path))


def cited_paths(text):
    return sorted({m.group(1) for m in PATH.finditer(text)})


def test_the_path_pattern_finds_what_it_must():
    text = "see kernels/gdpa/pallas.py, tests/test_kernels_*.py and docs/kernels.md."
    assert cited_paths(text) == ["docs/kernels.md", "kernels/gdpa/pallas.py", "tests/test_kernels_*.py"]
    assert not _exists("kernels/NOTES.md") and _exists("docs/kernels.md.")
    assert MARKDOWN.findall("Timings: DESIGN.md 3.5; README.md") == ["DESIGN.md", "README.md"]


def test_every_cited_repository_path_exists():
    sources = (_files(("gemjax", "kernels", "experiments", "benchmarks", "tools"), ("py", "sh"))
               + _files(("docs",), ("md",)) + [os.path.join(ROOT, "README.md")])
    missing = []
    for f in sources:
        for path in cited_paths(open(f).read()):
            if not _exists(path):
                missing.append(f"{os.path.relpath(f, ROOT)}: {path}")
    assert not missing, "paths cited but absent from the repository:\n" + "\n".join(missing)


def test_library_text_names_no_absent_markdown_file():
    present = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)
               if "/.venv/" not in p}
    absent = []
    for f in _files(("gemjax", "kernels"), ("py",)):
        for name in MARKDOWN.findall(open(f).read()):
            if name not in present:
                absent.append(f"{os.path.relpath(f, ROOT)}: {name}")
    assert not absent, "library text names Markdown files the repository lacks:\n" + "\n".join(absent)


def _markdown_pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(path):
    """The relative links of one Markdown file whose file (or heading) does not exist."""
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(target)
    return bad


def test_the_link_check_finds_what_it_must(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n\n[b](b.md) [gone](c.md) [x](b.md#no-such) "
                                   "[ok](b.md#the-steps-time) [self](#its-part) [web](https://x.org/y)\n")
    (tmp_path / "b.md").write_text("# B\n\n### The step's time\n")
    assert broken_links(str(tmp_path / "a.md")) == ["c.md", "b.md#no-such"]


def test_every_relative_link_resolves():
    bad = [f"{os.path.relpath(p, ROOT)}: {t}" for p in _markdown_pages() for t in broken_links(p)]
    assert not bad, "links to files or headings that do not exist:\n" + "\n".join(bad)


def test_readme_links_every_docs_page():
    readme = open(os.path.join(ROOT, "README.md")).read()
    linked = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(readme)}
    pages = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert pages, "docs/ has no page"
    missing = [p for p in pages if p not in linked]
    assert not missing, "docs pages the README does not link: " + ", ".join(missing)
