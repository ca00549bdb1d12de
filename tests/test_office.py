"""Read of .docx, .xlsx, .pptx and .pdf through the `office` extra: text, budgets, continuation, missing extra."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentnb.engine.tokens import counter_for_model
from agentnb.tools.base import ToolContext, ToolOutput, get_tool

COUNTER = counter_for_model("gpt-4o")


def _ctx(root: Path, budget: int = 60_000) -> ToolContext:
    return ToolContext(workdir=root, logs_dir=root / "logs", budget_tokens=budget, chars_per_token=3.5,
                       count_tokens=COUNTER.count)


def _read(root: Path, budget: int = 60_000, **args: Any) -> ToolOutput:
    return get_tool("Read").invoke(_ctx(root, budget), args)  # type: ignore[union-attr]


def _docx(path: Path, paragraphs: list[str]) -> None:
    docx = pytest.importorskip("docx")
    d = docx.Document()
    for p in paragraphs:
        d.add_paragraph(p)
    table = d.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "cell A", "cell B"
    d.save(str(path))


def _xlsx(path: Path) -> None:
    openpyxl = pytest.importorskip("openpyxl")
    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Costs"
    ws.append(["item", "price"])
    ws.append(["tea", 3.5])
    wb.create_sheet("Notes").append(["ünïcode ✓"])
    wb.save(str(path))


def _pptx(path: Path) -> None:
    pptx = pytest.importorskip("pptx")
    from pptx.util import Inches

    prs = pptx.Presentation()
    for n in range(2):
        slide = prs.slides.add_slide(prs.slide_layouts[5])
        slide.shapes.title.text = f"Slide title {n + 1}"
        box = slide.shapes.add_textbox(Inches(1), Inches(2), Inches(5), Inches(1))
        box.text_frame.text = f"body text {n + 1}"
    prs.save(str(path))


def _pdf(path: Path, pages: int, lines: int = 40) -> None:
    pytest.importorskip("pypdf")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    # TrueType (42) rather than Type 3 fonts, so the text can be extracted again
    with plt.rc_context({"pdf.fonttype": 42}), PdfPages(str(path)) as pdf:
        for page in range(pages):
            fig = plt.figure(figsize=(8.5, 11))
            for i in range(lines):
                fig.text(0.05, 0.96 - i * 0.023, f"page {page + 1} line {i} the quick brown fox", fontsize=9)
            pdf.savefig(fig)
            plt.close(fig)


def test_docx_xlsx_pptx_pdf_text(tmp_path: Path) -> None:
    _docx(tmp_path / "a.docx", ["First paragraph.", "Second — with ümlauts."])
    _xlsx(tmp_path / "b.xlsx")
    _pptx(tmp_path / "c.pptx")
    _pdf(tmp_path / "d.pdf", pages=2, lines=3)
    assert _read(tmp_path, path="a.docx").content == "First paragraph.\nSecond — with ümlauts.\ncell A\tcell B\n"
    assert _read(tmp_path, path="b.xlsx").content == "# sheet: Costs\nitem\tprice\ntea\t3.5\n# sheet: Notes\nünïcode ✓\n"
    pptx_text = _read(tmp_path, path="c.pptx").content
    assert pptx_text.splitlines() == ["# slide 1", "Slide title 1", "body text 1", "# slide 2", "Slide title 2",
                                      "body text 2"]
    pdf = _read(tmp_path, path="d.pdf")
    assert not pdf.is_error, pdf.content
    assert pdf.content.startswith("# page 1\npage 1 line 0 the quick brown fox")
    assert "# page 2\npage 2 line 0" in pdf.content and "page 2 line 2 the quick brown fox" in pdf.content
    # offset and limit address lines of the extracted text, as for a text file
    assert _read(tmp_path, path="b.xlsx", offset=2, limit=2).content == "item\tprice\ntea\t3.5\n"


@pytest.mark.parametrize("kind", ["docx", "pdf"])
def test_long_documents_are_budgeted_and_continued(tmp_path: Path, kind: str) -> None:
    if kind == "docx":
        _docx(tmp_path / "long.docx", [f"Paragraph {i}: " + "lorem ipsum dolor sit amet " * 8 for i in range(400)])
    else:
        _pdf(tmp_path / "long.pdf", pages=12)
    name = f"long.{kind}"
    full = _read(tmp_path, path=name)
    assert not full.truncated and not full.is_error
    args: dict[str, Any] = {"path": name}
    pieces = []
    while True:
        out = _read(tmp_path, 400, **args)
        assert not out.is_error, out.content
        assert COUNTER.count(out.content) <= 400
        pieces.append(out)
        if not out.truncated:
            break
        assert "truncated automatically" in out.content and "of the document's text" in out.content
        assert f"call Read with path='{name}' and offset=" in out.content
        assert out.original_chars == len(full.content) or args.get("offset")
        args = dict(out.continuation or {})
    assert len(pieces) > 3
    assert "".join(p.content[: p.returned_chars] for p in pieces) == full.content


def test_a_damaged_document_is_a_tool_error(tmp_path: Path) -> None:
    (tmp_path / "bad.docx").write_bytes(b"this is not a zip file")
    out = _read(tmp_path, path="bad.docx")
    assert out.is_error and "cannot read bad.docx" in out.content


@pytest.mark.parametrize(("suffix", "module", "package"), [
    ("docx", "docx", "python-docx"), ("xlsx", "openpyxl", "openpyxl"), ("pptx", "pptx", "python-pptx"),
    ("pdf", "pypdf", "pypdf"),
])
def test_a_missing_library_names_the_office_extra(tmp_path: Path, suffix: str, module: str, package: str) -> None:
    (tmp_path / f"x.{suffix}").write_bytes(b"whatever")
    script = textwrap.dedent(
        f"""
        import json, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r} or name.startswith({module!r} + "."):
                    raise ImportError("blocked for this test")
                return None
        sys.meta_path.insert(0, Block())
        from pathlib import Path
        from agentnb.tools.base import ToolContext, get_tool
        root = Path(sys.argv[1])
        out = get_tool("Read").invoke(ToolContext(workdir=root, logs_dir=root), {{"path": "x.{suffix}"}})
        print(json.dumps({{"error": out.is_error, "content": out.content}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["error"] is True
    assert f"needs the {package!r} package" in out["content"]
    assert "office" in out["content"] and "pip install 'agentnb[office]'" in out["content"]
