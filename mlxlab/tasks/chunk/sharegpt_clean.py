"""ShareGPT's messages cleaned and its conversations filtered (sharegpt.py reads and re-joins
them, then applies these in order):

1. `structure`: system messages dropped; human/gpt only, human first, strictly alternating, no
   empty message; an unanswered last user message is trimmed; at least 4 messages.
2. `clean_text`: browser-extension and UI artifacts cut out of the texts ("Share Prompt",
   regenerate counters "2 / 2", "Translate now" / "지금 번역하기", AIPRM's "Please write in English
   language.", "Save & SubmitCancel", "CopyCopy HTMLRead Aloud ... 7 chars | 2 words", "Copy
   code", zero-width spaces, markdown-escaped `\\_` / `\\*` in user text, `<br>` outside code,
   code fences the UI mislabelled ```arduino / ```vbnet / ```scss / ```less).
3. `reject_reason`: content filters (role-play/jailbreak/act-as, template junk left after
   cleaning, web-search pastes, chats that start mid-way, sexual content, "continue" chains,
   pasted documents, HTML outside code, over 76 messages); `prompt_key`: a first user message
   normalised, by which copies of the same demo prompt are found.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# ------------------------------------------------------------------------------ cleaning

ROLE = {"human": "user", "gpt": "assistant"}


class Message(NamedTuple):
    sender: str  # "user" | "assistant"
    text: str


ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
# Artifacts glued to the end of a user message by browser extensions / the ChatGPT UI; they
# stack ("...지금 번역하기CopyCopy HTMLRead Aloud⏹️ Stop7 chars | 2 words"), so they are cut
# from the end repeatedly (`_strip_tail`).
TAIL_ARTIFACTS = [
    re.compile(r"\s*Share Prompt\s*$"),
    re.compile(r"\s*Save & SubmitCancel\s*$"),
    re.compile(r"\s*(?:CopyCopy HTML)?\s*Read Aloud(?:⏹️ Stop)?\s*\d+ chars \| \d+ words\s*$"),
    re.compile(r"\s*CopyCopy HTML\s*$"),
    re.compile(r"\s*(?:지금 번역하기|Translate now)\s*$"),
    re.compile(r"\s*(?:Please )?write in [A-Za-z ()]{2,40}language\.?\s*$", re.I),
]
COUNTER = re.compile(r"(?<![\d/])(\d{1,2}) / (\d{1,2})\s*$")  # "...cobra1 / 1": regenerate count
# The same artifacts anywhere (the extension text also lands mid-message, before a newline).
INNER_ARTIFACTS = [
    re.compile(r"[ \t]*(?:지금 번역하기|Translate now)[ \t]*"),
    re.compile(r"Please write in [A-Za-z ()]{2,40}language\.?[ \t]*"),
    re.compile(r"Copy code(?=[ \t]*(?:\n|$))"),
]
AIPRM_SENTENCE = re.compile(
    r"(?:Please )?write in (?:an? )?[A-Za-z, ()-]{0,80}(?:tone|style|language)[A-Za-z, ()-]{0,80}"
    r"language\.?",
    re.I,
)
FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
BR = re.compile(r"<br\s*/?>", re.I)
MISLABELLED = ("arduino", "vbnet", "scss", "less")


def _outside_code(text: str, fn) -> str:
    """`fn` applied to the stretches of `text` outside fenced code blocks."""
    out, last = [], 0
    for m in FENCE.finditer(text):
        out.append(fn(text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(fn(text[last:]))
    return "".join(out)


def _strip_tail(text: str) -> str:
    if len(text) > 600:  # the artifacts are short: only the end is searched
        return text[:-400] + _strip_tail(text[-400:])
    while True:
        before = text
        for rx in TAIL_ARTIFACTS:
            text = rx.sub("", text)
        m = COUNTER.search(text)
        if m and 1 <= int(m.group(1)) <= int(m.group(2)) <= 20 and text[: m.start()].strip():
            # "2 / 2" (k = n: 335 of 344 in the file) anywhere; "1 / 3" only glued to the text
            # or after a line or sentence end ("what is 3 / 4" is a question)
            if m.group(1) == m.group(2) or not text[: m.start()].endswith(" "):
                text = text[: m.start()]
        if text == before:
            return text


def _br(text: str) -> str:
    lines = text.split("\n")
    return "\n".join(
        BR.sub(" ", ln) if ln.lstrip().startswith("|") else BR.sub("\n", ln) for ln in lines
    )


def fence_languages(user_text: str) -> frozenset[str]:
    """The `MISLABELLED` fence languages the user's messages name (their code fences are real)."""
    low = user_text.lower()
    return frozenset(lang for lang in MISLABELLED if re.search(rf"\b{lang}\b", low))


def clean_text(text: str, sender: str, keep_fences: frozenset[str] = frozenset()) -> str:
    """`text` without the UI/extension artifacts ShareGPT kept (see the module docstring). An
    assistant's ```arduino / ```vbnet / ```scss / ```less fence loses its label unless the
    language is in `keep_fences` (`fence_languages` of the conversation's user messages)."""
    text = ZERO_WIDTH.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    if sender == "user":
        text = _strip_tail(text.rstrip())
        text = AIPRM_SENTENCE.sub("", text)
        for rx in INNER_ARTIFACTS:
            text = rx.sub("", text)
        text = _outside_code(text, lambda s: re.sub(r"\\([_*])", r"\1", s))
        text = _strip_tail(text.rstrip())
    else:
        text = re.sub(r"Copy code(?=[ \t]*\n)", "", text)
        if "```" in text:
            for lang in MISLABELLED:
                if lang not in keep_fences:
                    text = re.sub(rf"^([ \t]*)```{lang}[ \t]*$", r"\1```", text, flags=re.M)
    text = _outside_code(text, _br)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def structure(raw: list[dict]) -> tuple[list[tuple[str, str]] | None, str | None]:
    """[(sender, text)] of a raw message list, or (None, why not): system messages dropped,
    human/gpt only, human first, alternating, no empty message, an unanswered last user message
    trimmed, at least 4 messages. Texts are only stripped here."""
    msgs = [m for m in raw if m.get("from") != "system"]
    if any(m.get("from") not in ROLE for m in msgs):
        return None, "other_role"
    if any(not str(m.get("value") or "").strip() for m in msgs):
        return None, "empty_message"
    if not msgs or msgs[0]["from"] != "human":
        return None, "not_user_first"
    if any(a["from"] == b["from"] for a, b in zip(msgs, msgs[1:], strict=False)):
        return None, "not_alternating"
    if msgs[-1]["from"] == "human":
        msgs = msgs[:-1]
    if len(msgs) < 4:
        return None, "lt4_messages"
    return [(ROLE[m["from"]], m["value"].strip()) for m in msgs], None


def clean_messages(pairs: list[tuple[str, str]], keep_empty: bool = False) -> list[Message] | None:
    """The messages with `clean_text` applied; None when one is left empty (with `keep_empty`:
    that message keeps its stripped original text, so the count never changes)."""
    keep = fence_languages("\n".join(t for s, t in pairs if s == "user"))
    out = []
    for sender, text in pairs:
        cleaned = clean_text(text, sender, keep)
        if not cleaned:
            if not keep_empty:
                return None
            cleaned = text.strip()
        out.append(Message(sender, cleaned))
    return out


# ------------------------------------------------------------------------------ content filters

CONTINUE_RE = re.compile(
    r"^\W*(please\s+)?(continue|go on|keep going|more|next|ok(ay)?|yes|thanks?( you)?|great|"
    r"go ahead|and\??|finish|cont\.?|continue writing( please)?|continue generating)\W*$",
    re.I,
)
ANAPHOR_RE = re.compile(
    r"^\W*(it|its|it's|this|that|these|those|they|them|he|she|his|her|and|also|now|then|but|ok|"
    r"okay|so|what about|how about|can you (also|make|add|change|rewrite|shorten|expand)|"
    r"make (it|this|that)|rewrite|shorter|longer|more|again|another|same|why|"
    r"give me (more|another)|expand|elaborate|continue|translate|in (english|french|spanish)|"
    r"the (first|second|third|last|previous|above|same)|number|option|#?\d+\b|great|thanks?|"
    r"thank you|perfect|good|nice|cool|yes|no|yeah|nope|wow|excellent|awesome|i see|correct|"
    r"wrong|actually|instead|please (continue|go on|expand|elaborate|rewrite|make)|"
    r"(rewrite|redo|revise|shorten|summarize|summarise|improve|fix|change|update|edit|modify|"
    r"refactor|convert|add|remove|include|use) (it|this|that|them|these|those|the above|your)\b|"
    r"(write|do|give|make|tell) (it|that|this|one|some|me)? ?(more|again|another)\b|"
    r"(in|with|without|using) (more|less|a|the) |"
    r"what (does|do|did) (it|this|that|you mean)|is (it|this|that)\b|are (they|these|those)\b|"
    r"you (said|wrote|forgot|missed|stopped|didn't|did not|are wrong|incorrectly|misunderstood|"
    r"made|mean|meant)|did you|do you mean|are you sure)",
    re.I,
)
ROLEPLAY_RE = re.compile(
    r"\bDAN\b|jail ?break|developer mode|pretend (to be|you are|you\'re)|role[- ]?play|"
    r"stay in character|text[- ]based (adventure|game)|let\'?s play a game|you will act as|"
    r"i want you to act as|act as (a|an|my|if)\b|"
    r"ignore (all )?(the )?(previous|prior|above) (instructions|prompts)|"
    r"from now on,? you (are|will)|you are (now )?(a|an) [a-z ]{0,30}(named|called)|simulate|"
    r"dungeon master",
    re.I,
)
TEMPLATE_RE = re.compile(
    r"\[TARGETLANGUAGE\]|\[PROMPT\]|AIPRM|지금 번역하기|Translate now|\[INFO: you can add images|"
    r"source\.unsplash\.com",
    re.I,
)
STARTS_MID_RE = re.compile(
    r"^\W*(continue|go on|keep going|the (code|answer|story|text|list|table) (you|above)|"
    r"you (wrote|said|forgot|stopped)|(please )?(finish|complete) (your|the) (answer|response)|"
    r"rewrite (it|this|that)|same (as|but)|now (do|make|write)|and (then|also)\b)",
    re.I,
)
# A first message that leans on a conversation we do not have ("more options like the first
# two", "as you said", "your last answer").
REFERS_BACK_RE = re.compile(
    r"\b(?:the (?:first|second|third|last|previous|above) (?:one|two|three|option|answer|"
    r"response|example|version|list|code|paragraph|idea)s?|as (?:you|i) (?:said|mentioned)|"
    r"(?:you|your) (?:previous|last|earlier) (?:answer|response|message|reply)|"
    r"(?:mentioned|said|wrote|listed|provided|given) (?:above|earlier|before)|the above)\b",
    re.I,
)
HTML_RE = re.compile(r"<(div|span|p|br|a|img|table|tr|td|li|ul)\b[^>]*>")
SEXUAL_RE = re.compile(r"\b(sex|sexy|nsfw|erotic|porn|nude|fetish)\b", re.I)
MAX_MESSAGES = 76


def strip_code(text: str) -> str:
    return FENCE.sub("", text)


def reject_reason(msgs: list[Message]) -> str | None:
    """Why a cleaned conversation is not used (None: it is)."""
    users = [m.text for m in msgs if m.sender == "user"]
    chars = sum(len(m.text) for m in msgs)
    utext = "\n".join(users)
    if (
        CONTINUE_RE.match(users[0])
        or STARTS_MID_RE.match(users[0])
        or (len(users[0]) < 300 and REFERS_BACK_RE.search(users[0]))
    ):
        return "starts mid-conversation"
    if "Web search results:" in utext:
        return "web-search template (pasted search results)"
    if ROLEPLAY_RE.search(utext):
        return "role-play/jailbreak/act-as"
    if TEMPLATE_RE.search(utext):
        return "prompt-template junk (AIPRM)"
    if SEXUAL_RE.search(utext):
        return "sexual content"
    if sum(bool(CONTINUE_RE.match(u)) for u in users) / len(users) > 0.34:
        return 'mostly "continue" turns'
    max_msg = max(len(m.text) for m in msgs)
    if (
        max(len(u) for u in users) > 5000
        or (max_msg / chars > 0.5 and len(msgs) >= 6)
        or sum(map(len, users)) / chars > 0.6
    ):
        return "dominated by a pasted document"
    if len(msgs) > MAX_MESSAGES:
        return f"more than {MAX_MESSAGES} messages"
    if chars > 200_000:
        return "more than 200k characters"
    if any(HTML_RE.search(strip_code(m.text)) for m in msgs):
        return "HTML tags outside code blocks"
    return None


def prompt_key(text: str) -> str:
    """A first user message normalised (lower case, letters and digits, first 200): chats that
    share it are copies of one demo prompt."""
    return "".join(ch for ch in text.lower() if ch.isalnum())[:200]
