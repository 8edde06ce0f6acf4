"""``docs/hazards.md``, rendered from the hazard catalogue (``_hazards``) and the patch records
(``_patches``): ``python -m threadgraph hazards [--write docs/hazards.md]``."""

from __future__ import annotations

from threadgraph._diagnostics.hazards import HAZARDS, READ_RELEASES, RUN_CPU, RUN_GPU, SIMULATED


def markdown() -> str:
    """``docs/hazards.md``: the catalogue and every patch's record. Independent of the installed
    torch (no detection results), so the committed page can be compared with a fresh render."""
    from threadgraph._patches import PATCHES

    lines = [
        "# Hazards",
        "",
        "Generated from `src/threadgraph/_hazards.py` and the patch records in `src/threadgraph/_patches.py`",
        "by `python -m threadgraph hazards --write docs/hazards.md`; edit those, not this page.",
        "`python -m threadgraph doctor` says which hazards the installed torch has.",
        "",
        f"Source read: {READ_RELEASES}. Run: {RUN_CPU}; {RUN_GPU}. {SIMULATED}.",
        "",
        "| hazard | how it is known | patches |",
        "|---|---|---|",
    ]
    by_hazard = {h.name: [p.name for p in PATCHES if p.hazard == h.name] for h in HAZARDS}
    for hazard in HAZARDS:
        patches = ", ".join(f"`{n}`" for n in by_hazard[hazard.name]) or "none"
        lines.append(f"| [`{hazard.name}`](#{hazard.name}) | {hazard.detection} | {patches} |")
    for hazard in HAZARDS:
        upstream = ", ".join(f"<{url}>" for url in hazard.upstream) or "none known"
        lines += [
            "",
            f"## {hazard.name}",
            "",
            hazard.summary,
            "",
            f"- How it is known: {hazard.detection}.",
            f"- Affected releases: {hazard.affected}.",
            f"- Verified: {hazard.verified}.",
            f"- Upstream: {upstream}.",
            f"- Patches: {', '.join(f'`{n}`' for n in by_hazard[hazard.name]) or 'none'}.",
        ]
        if hazard.mitigation:
            lines.append(f"- Besides patches: {hazard.mitigation}")
    lines += ["", "## Patches", "", "Each patch as `threadgraph.patches()` reports it."]
    for patch in PATCHES:
        lines += [
            "",
            f"### {patch.name}",
            "",
            f"- Wraps: `{patch.target}`; hazard: [`{patch.hazard}`](#{patch.hazard}).",
            f"- Applies to: {patch.releases}.",
            f"- Removable when: {patch.removable_when}.",
            f"- Upstream: {patch.upstream}.",
            f"- Read: {patch.read}.",
            f"- Run: {patch.run}.",
            f"- What changed between them: {patch.changes.rstrip('.')}.",
        ]
    return "\n".join(lines) + "\n"
