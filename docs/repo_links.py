"""mkdocs hook: a page's relative link to a file of the repository outside docs/ (the benchmarks'
README, a results file, the trainer's README) points to that file on GitHub in the built site, and
a link to a file that does not exist fails the build (a warning, which `strict: true` makes fatal)."""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.repo_links")

ROOT = Path(__file__).resolve().parents[1]
BLOB = "https://github.com/threadgraph/threadgraph/blob/main/"
LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    page_dir = posixpath.dirname(posixpath.join("docs", page.file.src_uri))

    def rewrite(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(page_dir, match.group(1)))
        if target.startswith("docs/") or target.startswith(".."):
            return match.group(0)  # inside docs/: mkdocs checks it; outside the repository: left alone
        if not (ROOT / target).exists():
            log.warning("Doc file '%s' links to '%s', which is not a file of the repository", page.file.src_uri, target)
            return match.group(0)
        return f"]({BLOB}{target}{match.group(2) or ''})"

    return LINK.sub(rewrite, markdown)
