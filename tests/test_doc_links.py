"""docs/architecture.md's walks link into the code by `file:line` ([`TalkerEngine.step`](../omni_tts/engine/
talker_engine.py#L72)): each link must land on the definition it names, so the page cannot drift from the code
silently. A failure says where the definition is now."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
LINK = re.compile(r"\[`([\w.]+)`\]\(\.\./(omni_tts/[\w/]+\.py)#L(\d+)\)")


def definition_line(path: Path, symbol: str) -> int | None:
    """The line (1-based) defining `symbol` in `path`: `name`, or `Class.name` (the first `name` after the class)."""
    lines = path.read_text().splitlines()
    *owner, name = symbol.split(".")
    start = 0
    if owner:
        found = next((i for i, line in enumerate(lines) if re.match(rf"\s*class {owner[-1]}\b", line)), None)
        if found is None:
            return None
        start = found
    pattern = re.compile(rf"\s*(async def|def|class) {name}\b|{name}\s*[:=]")
    return next((i + 1 for i in range(start, len(lines)) if pattern.match(lines[i])), None)


def test_the_page_links_into_the_code():
    links = LINK.findall(PAGE.read_text())
    assert len(links) >= 20  # the life of a frame
    wrong = []
    for symbol, path, line in links:
        actual = definition_line(ROOT / path, symbol)
        if actual != int(line):
            wrong.append(f"{symbol} in {path}: linked at line {line}, defined at {actual}")
    assert wrong == []


def test_a_link_to_a_moved_definition_is_caught(tmp_path):
    """The check above is only as good as `definition_line`: a method found under its class, not elsewhere."""
    source = tmp_path / "m.py"
    source.write_text("def step():\n    pass\n\n\nclass Engine:\n    x: int = 0\n\n    def step(self):\n        pass\n")
    assert definition_line(source, "step") == 1
    assert definition_line(source, "Engine.step") == 8
    assert definition_line(source, "Engine.missing") is None
