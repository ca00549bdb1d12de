"""Text of Office documents and PDFs, through the libraries of the ``office`` extra.

Read serves the extracted text like a text file (lines, offsets, continuation
notes), so a long document is read in budgeted pieces.  Each piece would parse
the document again; a small cache keyed by the file's identity avoids that.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import ToolError

__all__ = ["OFFICE_SUFFIXES", "extract_text"]

OFFICE_SUFFIXES = (".docx", ".xlsx", ".pptx", ".pdf")
_EXTRA = "pip install 'agentnb[office]'"
_cache: OrderedDict[tuple[str, int, int, int], str] = OrderedDict()
_lock = threading.Lock()


def _need(module: str, package: str, suffix: str) -> None:
    raise ToolError(
        f"reading {suffix} files needs the {package!r} package (module {module!r}) of the 'office' extra, "
        f"which is not installed; install it with {_EXTRA}"
    )


def extract_text(path: Path) -> str:
    """The document's text, paragraph by paragraph (sheets row by row, slides shape by shape, pages)."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    text = _extract(path)
    with _lock:
        _cache[key] = text
        while len(_cache) > 4:
            _cache.popitem(last=False)
    return text


def _extract(path: Path) -> str:
    suffix = path.suffix.lower()
    try:
        if suffix == ".docx":
            try:
                import docx
            except ImportError:
                _need("docx", "python-docx", suffix)
            document = docx.Document(str(path))
            parts = [p.text for p in document.paragraphs]
            for table in document.tables:
                for row in table.rows:
                    parts.append("\t".join(cell.text for cell in row.cells))
            return "\n".join(parts) + "\n"
        if suffix == ".xlsx":
            try:
                import openpyxl
            except ImportError:
                _need("openpyxl", "openpyxl", suffix)
            wb = openpyxl.load_workbook(str(path), read_only=True, data_only=True)
            lines: list[str] = []
            for ws in wb.worksheets:
                lines.append(f"# sheet: {ws.title}")
                for row in ws.iter_rows(values_only=True):
                    lines.append("\t".join("" if v is None else str(v) for v in row))
            wb.close()
            return "\n".join(lines) + "\n"
        if suffix == ".pptx":
            try:
                import pptx
            except ImportError:
                _need("pptx", "python-pptx", suffix)
            prs = pptx.Presentation(str(path))
            lines = []
            for n, slide in enumerate(prs.slides, start=1):
                lines.append(f"# slide {n}")
                for shape in slide.shapes:
                    if getattr(shape, "has_text_frame", False) and shape.text_frame.text:
                        lines.append(shape.text_frame.text)
            return "\n".join(lines) + "\n"
        if suffix == ".pdf":
            try:
                import pypdf
            except ImportError:
                _need("pypdf", "pypdf", suffix)
            reader = pypdf.PdfReader(str(path))
            pages = []
            for n, page in enumerate(reader.pages, start=1):
                pages.append(f"# page {n}\n{page.extract_text() or ''}")
            return "\n".join(pages) + "\n"
    except ToolError:
        raise
    except Exception as exc:  # a damaged document is the model's to know about
        raise ToolError(f"cannot read {path.name}: {type(exc).__name__}: {exc}") from None
    raise ToolError(f"{path.name}: not an Office document or PDF")
