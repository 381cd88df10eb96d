"""Stable image ids over a conversation, the filename table, and the messages a model sees.

Chat messages reach here in the chat-template form, where a user message's content may be a list
of parts: `{"type": "text", "text"}` and image parts (`image_part`), each carrying the content
hash of its bytes (`digest`) once they are known.

- Ids (`assign_ids`): the whole history is scanned in order; each new content hash gets the next
  number ("Image 1, 2, ..."), so a re-uploaded image keeps its id. Assistant messages may carry
  the filename table an earlier answer began with (`<!-- mlxk:filenames -->`, rows
  `| N | image_<hash8>.<ext> | ...`): its rows restore the ids of images whose bytes the client
  has since dropped from the history. Nothing is stored on the server.
- The table (`render_table`): the images of the last user message with their ids, file names
  and, unless turned off, the EXIF columns (Original, Location, Date, Camera).
- What the model sees (`model_messages`): only the last user message's images as pixels, each
  after a `[Image N]` label; earlier images become the label alone; filename tables are taken out
  of earlier answers (a model shown them tends to copy them).
"""

from __future__ import annotations

import re

TABLE_MARK = "<!-- mlxk:filenames -->"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*image_([0-9a-f]{8})\.[A-Za-z0-9]+\s*\|", re.MULTILINE)
_BLOCK = re.compile(
    r"<details>\s*<summary>[^<]*</summary>\s*" + re.escape(TABLE_MARK) + r".*?</details>\s*",
    re.DOTALL,
)
_BARE = re.compile(re.escape(TABLE_MARK) + r"[ \t]*\n(?:[ \t]*\|[^\n]*(?:\n|$))*\s*")
EMPTY = "-"


def has_payload(part: dict) -> bool:
    """Whether an image part carries its image (bytes, base64, a data: or http(s) URL), rather
    than only its hash (as a stored conversation keeps it)."""
    url = (part.get("url") or "").lower()
    return (
        part.get("bytes") is not None
        or part.get("b64") is not None
        or url.startswith(("data:", "http://", "https://"))
    )


def image_part(where: str, **fields) -> dict:
    """An image part in the chat-template form: `where` (the request field, for errors) and any
    of `url`, `bytes`, `mime` (the declared type), `name` (the original file name), `digest`."""
    part = {"type": "image", "where": where, "url": None, "bytes": None, "mime": None}
    part.update(name=None, digest=None, picture=None)
    part.update(fields)
    return part


def is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def parts_of(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def images_in(message: dict) -> list[dict]:
    return [p for p in parts_of(message) if is_image(p)]


def last_user(messages: list[dict]) -> int | None:
    """Index of the last user message (whose images the model is shown), or None."""
    return next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None
    )


def text_of(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in parts_of(message) if p.get("type") == "text")


def table_rows(text: str) -> list[tuple[int, str]]:
    """(id, 8-hex hash prefix) of every row of the filename tables in `text`."""
    rows = []
    at = text.find(TABLE_MARK)
    while at >= 0:
        end = text.find(TABLE_MARK, at + 1)
        chunk = text[at : end if end >= 0 else len(text)]
        rows += [(int(n), h) for n, h in _ROW.findall(chunk)]
        at = end
    return rows


def strip_tables(text: str) -> str:
    """`text` without the filename tables (and their <details> wrapper)."""
    if TABLE_MARK not in text:
        return text
    return _BARE.sub("", _BLOCK.sub("", text)).strip()


def assign_ids(messages: list[dict]) -> dict[str, int]:
    """8-hex hash prefix -> image id, over the whole history (see the module docstring)."""
    ids: dict[str, int] = {}
    nxt = 1
    for m in messages:
        if m["role"] == "assistant":
            for n, h in table_rows(text_of(m)):
                if h not in ids and n not in ids.values():
                    ids[h] = n
                nxt = max(nxt, n + 1)
            continue
        for part in images_in(m):
            h = (part.get("digest") or "")[:8]
            if h and h not in ids:
                while nxt in ids.values():
                    nxt += 1
                ids[h] = nxt
                nxt += 1
    return ids


def image_id(ids: dict[str, int], part: dict) -> int:
    return ids[part["digest"][:8]]


def label(n: int) -> str:
    return f"[Image {n}]"


def model_messages(messages: list[dict], ids: dict[str, int], shown=()) -> list[dict]:
    """The messages as the chat template should render them for the model: the image parts in
    `shown` (those of the last user message the model is given) stay image parts
    (`{"type": "image"}`), each after its label; every other image becomes its label; filename
    tables are taken out of assistant messages; content that is all text is joined."""
    shown_ids = {id(p) for p in shown}
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("content"):
            m["content"] = strip_tables(text_of(m))
        elif isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if not is_image(p):
                    parts.append(p)
                    continue
                parts.append({"type": "text", "text": label(image_id(ids, p))})
                if id(p) in shown_ids:
                    parts.append({"type": "image"})
            if all(p.get("type") == "text" for p in parts):
                m["content"] = "".join(p["text"] for p in parts)
            else:
                m["content"] = parts
        out.append(m)
    return out


def _cell(value) -> str:
    return str(value).replace("|", "/").replace("\n", " ") if value else EMPTY


def render_table(rows: list[tuple[int, object, str | None]], exif: bool = True) -> str:
    """The filename table an answer begins with: one row per (id, Picture, original file name),
    wrapped in <details> so chat UIs fold it; ends with a blank line before the answer."""
    n = len(rows)
    head = "| Image | Filename |" + (" Original | Location | Date | Camera |" if exif else "")
    rule = "|-------|----------|" + ("----------|----------|------|--------|" if exif else "")
    lines = [
        "<details>",
        f"<summary>📸 Image Metadata ({n} image{'s' if n != 1 else ''})</summary>",
        "",
        TABLE_MARK,
        head,
        rule,
    ]
    for num, pic, original in rows:
        row = f"| {num} | {pic.filename} |"
        if exif:
            meta = pic.meta
            row += (
                f" {_cell(original)} |"
                f" {'📍 ' + meta['location'] if meta.get('location') else EMPTY} |"
                f" {'📅 ' + meta['date'] if meta.get('date') else EMPTY} |"
                f" {_cell(meta.get('camera'))} |"
            )
        lines.append(row)
    return "\n".join([*lines, "", "</details>", "", ""])
