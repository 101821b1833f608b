"""docs/claims.md, the interview answer's claims and where each is measured, is kept in
step with the notebooks' cell tags (`claim-Cnn`): every claim has a measuring code cell in
exactly the notebooks the page names, and every tag is a claim of the page. The tagged
cells assert what they measure; tests/test_notebooks.py runs them."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (C\d\d) \| (.+?) \| (.+?) \| ([\d, ]+) \|$")


def claim_rows() -> dict[str, dict]:
    rows = {}
    for line in (ROOT / "docs" / "claims.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            claim, text, status, notebooks = match.groups()
            assert claim not in rows, f"{claim} is on the page twice"
            rows[claim] = {"text": text, "status": status,
                           "notebooks": {n.strip() for n in notebooks.split(",")}}
    return rows


def tagged_cells() -> dict[str, set[str]]:
    """{claim: notebooks (their two-digit prefix) with a code cell tagged claim-<claim>}."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for tag in cell.get("metadata", {}).get("tags", []):
                if tag.startswith("claim-"):
                    assert cell["cell_type"] == "code", f"{path.name}: {tag} on a markdown cell"
                    found.setdefault(tag.removeprefix("claim-"), set()).add(path.name[:2])
    return found


def test_the_page_lists_the_44_claims_in_order():
    assert list(claim_rows()) == [f"C{i:02d}" for i in range(1, 45)]


def test_every_claim_is_measured_where_the_page_says():
    rows, tags = claim_rows(), tagged_cells()
    for claim, row in rows.items():
        assert claim in tags, f"{claim} ({row['text']}) has no cell tagged claim-{claim}"
        assert tags[claim] == row["notebooks"], (
            f"{claim}: docs/claims.md names notebooks {sorted(row['notebooks'])}, the tags "
            f"are in {sorted(tags[claim])}")


def test_every_claim_tag_is_a_claim_of_the_page():
    assert set(tagged_cells()) <= set(claim_rows())


def test_the_corrected_claim_says_what_is_true():
    corrected = {c: row for c, row in claim_rows().items()
                 if row["status"].startswith("corrected")}
    assert set(corrected) == {"C35"}
    assert "not the first stage's activation peak" in corrected["C35"]["status"]
