"""Docs and library text cite only what the repository holds: every repository path named
in library code (gemjax/, kernels/), in the programs (experiments/, benchmarks/, tools/),
in docs/ and in README.md exists, and no library text names a Markdown file the
repository lacks (a design note kept elsewhere)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("gemjax", "kernels", "experiments", "benchmarks", "tools", "tests", "docs")
# a path under one of the top-level folders, e.g. kernels/gdpa/reference.py, tests/test_*.py
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w*.<>/-]*[\w*])" % "|".join(TOP))
MARKDOWN = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
AREAS = ("data", "sparse", "models", "parallel", "train", "kernels")


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


def test_readme_layout_points_to_a_design_note_per_area():
    readme = open(os.path.join(ROOT, "README.md")).read()
    layout = readme[readme.index("\n## Layout\n"):readme.index("\n## The contracts")]
    for area in AREAS:
        note = f"docs/{area}.md"
        assert note in layout and os.path.exists(os.path.join(ROOT, note)), note
